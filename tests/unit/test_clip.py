"""Clipping over gradient shards: the norm of the pieces is the norm of the whole, as torch computes it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from polytrain.config import ModelConfig
from polytrain.distributed.data_parallel import FSDP2DataParallel
from polytrain.distributed.materialize import materialize
from polytrain.distributed.pipeline import split_model
from polytrain.distributed.pipeline.plan import plan_pipeline
from polytrain.distributed.pipeline.tied import COPIES, TiedEmbeddings
from polytrain.distributed.topology import ParallelDims
from polytrain.models.llama.model import Llama
from polytrain.optim.clip import clip_coefficient, sharded_grad_norm
from tests.multirank import make_runtime


def test_norm_of_pieces_and_coefficient_match_torch():
    grads = [torch.randn(7, 3, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(4)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    ref = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    # The same gradients cut into row pieces, as ranks would hold them.
    pieces = [piece for g in grads for piece in g.chunk(3)]
    norm = sharded_grad_norm(pieces, group=None, device=torch.device("cpu"))
    assert norm.item() == pytest.approx(ref.item(), rel=1e-6)
    coef = clip_coefficient(norm, 1.0)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g * coef, p.grad)
    assert clip_coefficient(norm, math.inf).item() == 1.0
    assert clip_coefficient(norm, 10 * norm.item()).item() == 1.0


def test_a_rank_without_gradients_adds_zero():
    assert sharded_grad_norm([], group=None, device=torch.device("cpu")).item() == 0.0


def test_a_tied_weight_held_by_two_pipeline_stages_counts_once_in_the_norm():
    """Under pp the tied table's gradient exists twice (embedding and head copy, both the summed
    gradient); the norm must count it once to equal the single process's."""
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97, max_seq_len=16,
                      tie_embeddings=True)
    with torch.device("meta"):
        whole, meta = Llama(cfg), Llama(cfg)
    materialize(whole, torch.device("cpu"), seed=3)
    plan = plan_pipeline(1, "zero_bubble", 2, "", cfg.n_layers, 0, 1)  # ZB-V: both stages on this one rank
    stages = split_model(meta, plan, 0)
    for stage in stages.values():
        materialize(stage, torch.device("cpu"), seed=3, init_as=COPIES)
    first, last = stages["0"], stages["1"]
    assert torch.equal(last.output.weight, whole.tok_embeddings.weight)  # the copy starts as the original

    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))  # (B, T)
    targets = tokens.roll(-1, dims=1)
    F.cross_entropy(whole(tokens).flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(last(first(tokens)).flatten(0, 1), targets.flatten()).backward()
    TiedEmbeddings(stages, plan, mesh=None).sum_gradients()
    torch.testing.assert_close(last.output.weight.grad, whole.tok_embeddings.weight.grad)
    torch.testing.assert_close(first.tok_embeddings.weight.grad, whole.tok_embeddings.weight.grad)

    expected = torch.nn.utils.clip_grad_norm_(whole.parameters(), math.inf).item()
    strategies = []
    for stage in stages.values():
        strategies.append(FSDP2DataParallel(make_runtime(ParallelDims(world_size=1, dp_replicate=1, dp_shard=1, zero=0))))
        strategies[-1].parallelize(stage)
    once = sum(s.squared_norm_share(leave_out=COPIES) for s in strategies).sqrt().item()
    twice = sum(s.squared_norm_share() for s in strategies).sqrt().item()
    assert once == pytest.approx(expected, rel=1e-5)
    assert twice > expected * 1.01  # the bug this guards against
