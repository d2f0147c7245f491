"""Dropout streams: keyed by mesh coordinates, derived from the default generator, invisible outside."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from polytrain.backend import get_accelerator
from polytrain.distributed.rng import DropoutRNG


def rng(tp: int, dp: int = 0) -> DropoutRNG:
    return DropoutRNG(get_accelerator(), {"pp": 0, "dp_replicate": dp, "dp_shard": 0, "tp": tp})


def mask(streams: DropoutRNG, sharded: bool) -> torch.Tensor:
    torch.manual_seed(0)  # every rank of a tp group starts from the same default state
    with streams.fork(sharded):
        return torch.rand(64) < 0.5


def test_replicated_streams_agree_across_tp_and_sharded_ones_do_not():
    assert torch.equal(mask(rng(tp=0), sharded=False), mask(rng(tp=1), sharded=False))
    assert not torch.equal(mask(rng(tp=0), sharded=True), mask(rng(tp=1), sharded=True))
    # Data-parallel ranks see different samples: their masks differ even where tp shares one.
    assert not torch.equal(mask(rng(tp=0, dp=0), sharded=False), mask(rng(tp=0, dp=1), sharded=False))


def test_a_fork_advances_the_default_generator_by_one_draw_only():
    torch.manual_seed(3)
    with rng(0).fork(sharded=True):
        torch.rand(1000)
    after_fork = torch.rand(4)
    torch.manual_seed(3)
    torch.randint(0, 2**31, (1,))
    assert torch.equal(torch.rand(4), after_fork)


def test_checkpoint_recomputes_the_same_masks():
    streams = rng(0)
    x = torch.randn(8, 16, requires_grad=True)

    def dropped(t):
        with streams.fork(sharded=True):
            return torch.nn.functional.dropout(t, 0.5, training=True)

    torch.manual_seed(1)
    plain = torch.autograd.grad(dropped(x).pow(2).sum(), x)[0]
    torch.manual_seed(1)
    recomputed = torch.autograd.grad(checkpoint(dropped, x, use_reentrant=False).pow(2).sum(), x)[0]
    assert torch.equal(plain, recomputed)
