"""ZeroDataParallel on a toy model whose rows do not split evenly over 4 ranks (some shards empty).

Each rank also runs the single-process reference (the whole batch, a plain AdamW)
so the comparison needs no second spawn.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
WORLD = 4
STEPS = 3
MAX_NORM = 0.05  # below the toy's gradient norm, so clipping really scales


class Toy(nn.Module):
    """Parameters of 5, 2, 7 and 5 rows: at 4 ranks pieces of 2/2/1/0, 1/1/0/0, 2/2/2/1 rows."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 5)  # weight (5, 3), bias (5,)
        self.b = nn.Linear(5, 2)  # weight (2, 5), bias (2,)
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, 7))  # (7,)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """A mean of per-sample terms, so the mean over ranks' halves is the whole batch's."""
        y = self.b(torch.tanh(self.a(x)))  # (B, 2)
        return y.square().mean() + (self.g * x.mean(1, keepdim=True)).square().mean()  # (B, 7) -> ()


def _toy(seed: int) -> Toy:
    torch.manual_seed(seed)
    return Toy()


def _run(rank: int, world_size: int, stage: int, ckpt_dir: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from polytrain.backend import get_accelerator
    from polytrain.config import TrainConfig
    from polytrain.distributed.zero import ZeroDataParallel
    from polytrain.optim.builder import build_optimizer

    cfg = TrainConfig(lr=0.05)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    ref = _toy(0)
    ref_opt = build_optimizer(ref, cfg)
    zero = ZeroDataParallel(get_accelerator(), mesh, stage, bucket_bytes=40)  # a few parameters per bucket
    model = zero.parallelize(_toy(0))
    zero.build_optimizer(model, cfg)
    assert len(zero.buckets) >= 3
    data = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(2 * world_size * 2, 3, generator=data)  # (16, 3): 2 micro-batches of 2 per rank
        ref.loss(x).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = x[rank * 4:(rank + 1) * 4]
        for i in range(2):
            zero.before_micro_batch(model, last=i == 1)
            (model.loss(mine[2 * i:2 * i + 2]) / 2).backward()
        norm = zero.clip_grad_norm_(MAX_NORM)
        zero.step()
        zero.zero_grad()
        assert norm == pytest.approx(ref_norm, rel=1e-5) and norm > MAX_NORM, (norm, ref_norm)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)

    # Distributed Checkpoint: the sharded state (with empty shards) loads into a plain model.
    dcp.save(zero.state_dict(), checkpoint_id=str(ckpt_dir))
    plain = _toy(5)
    plain_opt = build_optimizer(plain, cfg)
    model_sd, optim_sd = get_state_dict(plain, plain_opt)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(ckpt_dir))
    set_state_dict(plain, plain_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    ref_state = get_state_dict(ref, ref_opt)[1]["state"]
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p, dict(ref.named_parameters())[name], rtol=1e-5, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(plain_opt.state[p][key], ref_state[name][key], rtol=1e-5, atol=1e-9)
        assert plain_opt.state[p]["step"].item() == STEPS

    # And a fresh ZeRO run loads it back (the other direction), as does load_state_dict from another instance.
    again = ZeroDataParallel(get_accelerator(), mesh, stage, bucket_bytes=1 << 20)  # other buckets: state is keyed by name
    again_model = again.parallelize(_toy(9))
    again.build_optimizer(again_model, cfg)
    sd = again.state_dict()
    dcp.load(sd, checkpoint_id=str(ckpt_dir))
    again.load_state_dict(sd)
    copied = ZeroDataParallel(get_accelerator(), mesh, stage, bucket_bytes=40)
    copied_model = copied.parallelize(_toy(11))
    copied.build_optimizer(copied_model, cfg)
    copied.load_state_dict(zero.state_dict())
    for other, other_zero in ((again_model, again), (copied_model, copied)):
        for (name, p), q in zip(other.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
        for fqn, state in other_zero.state_dict()["optim"]["state"].items():
            torch.testing.assert_close(state["exp_avg"].full_tensor(), ref_state[fqn]["exp_avg"],
                                       rtol=1e-5, atol=1e-9)
            assert state["step"].item() == STEPS


@pytest.mark.parametrize("stage", [1, 2])
def test_uneven_and_empty_shards(stage, tmp_path):
    run_ranks(WORLD, _run, stage, tmp_path / "ckpt")
