"""Tensor and sequence parallel layers against the single-device model, on spawned ranks.

Every rank builds the same single-device Llama and a tensor-parallel copy of it, runs
both on the same batch and compares: each block's output, the logits, the loss, every
parameter's gradient, greedy generation with a KV cache, and the bytes the collectives
sent. Dropout streams are checked for equal masks where activations are replicated and
different ones where they are sharded. With bf16 states and train.matmul_fp32, no GEMM
runs in bf16 and the loss and gradients follow the single-device model's.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from polytrain.config import ModelConfig
from tests.multirank import run_ranks, tp_parallelize

pytestmark = pytest.mark.slow

BASE = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512, max_seq_len=32)
B, T = 2, 16


def _setup(tp: int, sp: bool, cfg: ModelConfig, seed: int = 0, prepare=None, overlap: bool = False):
    """(reference model, tp model, tp context, mesh) on this rank; both start from the same weights.

    `prepare(model)` runs on the copy before it is parallelized. `overlap`: parallel.tp_overlap
    (regions reduce their input gradient while their columns' weight gradients are computed).
    """
    from polytrain.distributed.topology import ParallelDims
    from polytrain.models.common.init import init_plain
    from polytrain.models.llama.model import Llama

    torch.manual_seed(seed)  # as the trainer does: dropout streams fork from the default generator
    ref = Llama(cfg)
    init_plain(ref, seed)
    dims = ParallelDims(world_size=tp, dp_replicate=1, dp_shard=1, zero=0, tp=tp, sp=sp, tp_overlap=overlap)
    model = copy.deepcopy(ref)
    if prepare is not None:
        prepare(model)
    ctx, mesh = tp_parallelize(model, dims)
    return ref, model, ctx, mesh


def _full(x: torch.Tensor, ctx, dim: int) -> torch.Tensor:
    """This rank's shard along `dim` gathered from the tp group (for comparisons only)."""
    from polytrain.distributed.collectives import all_gather

    return all_gather(x.detach().contiguous(), dim, ctx.group)


def _block_outputs(model) -> tuple[list[torch.Tensor], list]:
    outs = []
    hooks = [block.register_forward_hook(lambda m, i, o: outs.append(o)) for block in model.layers.values()]
    return outs, hooks


def _compare_model(rank: int, world_size: int, sp: bool, overrides: dict, overlap: bool = False) -> dict:
    import torch.nn.functional as F

    from polytrain.distributed.collectives import comm_stats, gather_from_tp
    from polytrain.distributed.tensor_parallel import shard_sizes, vocab_parallel_loss
    from polytrain.inference.generate import generate

    cfg = dataclasses.replace(BASE, **overrides)
    ref, model, ctx, mesh = _setup(world_size, sp, cfg, overlap=overlap)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)

    ref_blocks, ref_hooks = _block_outputs(ref)
    ref_logits = ref(tokens)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()

    blocks, hooks = _block_outputs(model)
    with comm_stats() as stats:
        logits = model(tokens)  # (B, T, V/tp)
        loss = vocab_parallel_loss(mesh["tp"], cfg.vocab_size)(logits, targets)
        loss.backward()
    for h in ref_hooks + hooks:
        h.remove()

    for i, (a, b) in enumerate(zip(ref_blocks, blocks)):
        got = _full(b, ctx, 1) if sp else b  # under SP each rank holds (B, T/tp, D)
        torch.testing.assert_close(got, a, rtol=1e-5, atol=1e-5, msg=f"block {i} output")
    assert logits.shape[-1] == shard_sizes(cfg.vocab_size, world_size)[rank]
    full_logits = gather_from_tp(logits.detach(), -1, shard_sizes(cfg.vocab_size, world_size), ctx.group)
    torch.testing.assert_close(full_logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    ref_params = dict(ref.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert names == list(ref_params), "parameter names must not change"
    for name, param in model.named_parameters():
        assert param.full_tensor().shape == ref_params[name].shape
        torch.testing.assert_close(param.grad.full_tensor(), ref_params[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=f"gradient of {name}")
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight

    # KV-cached greedy decoding (prompts of different lengths) gives the single-device tokens.
    prompts = [[5, 17, 3, 88, 42], [23, 4]]
    assert generate(model, prompts, 8, temperature=0) == generate(ref, prompts, 8, temperature=0)
    return stats.as_dict()


def _compare_stages(rank: int, world_size: int) -> None:
    """Pipeline stages under SP: a stage without the embedding takes, and one without the head
    returns, this rank's residual stream (B, T/tp, D)."""
    from polytrain.distributed.collectives import scatter_to_sp
    from polytrain.distributed.tensor_parallel import shard_sizes

    def first_stage(model):
        model.norm = model.output = None
        del model.layers["1"]

    def last_stage(model):
        model.tok_embeddings = None
        del model.layers["0"]

    ref, first, ctx, _ = _setup(world_size, True, BASE, prepare=first_stage)
    _, last, _, _ = _setup(world_size, True, BASE, prepare=last_stage)
    tokens = torch.randint(0, BASE.vocab_size, (B, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref_blocks, hooks = _block_outputs(ref)
        ref_logits = ref(tokens)
        hidden = first(tokens)  # (B, T/tp, D): what this rank sends to the next stage
        assert hidden.shape == (B, T // world_size, BASE.dim)
        torch.testing.assert_close(hidden, scatter_to_sp(ref_blocks[0], 1, ctx.group), rtol=1e-5, atol=1e-5)
        logits = last(hidden)  # RoPE and causality over the full T although the input is T/tp long
    for h in hooks:
        h.remove()
    assert logits.shape[-1] == shard_sizes(BASE.vocab_size, world_size)[rank]
    torch.testing.assert_close(_full(logits, ctx, -1), ref_logits, rtol=1e-5, atol=1e-5)


def _frozen_after_first_backward(rank: int, world_size: int) -> None:
    """The overlapped entry takes a weight frozen after the first backward off its deferred path."""
    import torch.nn.functional as F

    from polytrain.distributed.tensor_parallel import vocab_parallel_loss

    ref, model, _, mesh = _setup(world_size, False, BASE, overlap=True)
    tokens = torch.randint(0, BASE.vocab_size, (B, T), generator=torch.Generator().manual_seed(7))
    tp_loss = vocab_parallel_loss(mesh["tp"], BASE.vocab_size)
    tp_loss(model(tokens), tokens).backward()
    for m in (ref, model):
        m.layers["0"].attention.wq.weight.requires_grad_(False)
        m.zero_grad(set_to_none=True)
    F.cross_entropy(ref(tokens).flatten(0, 1), tokens.flatten()).backward()
    tp_loss(model(tokens), tokens).backward()
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        if ref_params[name].grad is None:
            assert param.grad is None, name
        else:
            torch.testing.assert_close(param.grad.full_tensor(), ref_params[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=f"gradient of {name}")


def _bf16_states_overlap(rank: int, world_size: int) -> None:
    """16-bit model states train under autocast to their own dtype (the trainer's bf16): the
    overlapped entry still applies there, and its gradients are the plain path's."""
    from unittest import mock

    from polytrain.distributed.tensor_parallel import overlap, vocab_parallel_loss

    grads, started = {}, {}
    for on in (False, True):
        _, model, _, mesh = _setup(world_size, False, BASE, overlap=on)
        model.to(torch.bfloat16)
        gen = torch.Generator().manual_seed(3)
        tokens, targets = (torch.randint(0, BASE.vocab_size, (B, T), generator=gen) for _ in range(2))
        counting = mock.patch.object(overlap, "start_all_reduce", wraps=overlap.start_all_reduce)
        with counting as start, torch.autocast("cpu", dtype=torch.bfloat16):
            vocab_parallel_loss(mesh["tp"], BASE.vocab_size)(model(tokens), targets).backward()
        started[on] = start.call_count
        grads[on] = {name: p.grad.to_local().float() for name, p in model.named_parameters()}
    assert started == {False: 0, True: 2 * BASE.n_layers}, started  # one per attention and MLP region
    for name, grad in grads[True].items():  # bf16: the sums of dx may round in another order
        torch.testing.assert_close(grad, grads[False][name], rtol=2e-2, atol=2e-3, msg=name)


def _bf16_products_in_fp32(rank: int, world_size: int) -> None:
    """train.matmul_fp32 on the sharded layers at tp = 2, plain and with SP and the overlapped entry."""
    from polytrain.distributed.tensor_parallel import vocab_parallel_loss
    from tests.gemm_dtypes import assert_bf16_products_in_fp32

    gen = torch.Generator().manual_seed(4)
    tokens, targets = (torch.randint(0, BASE.vocab_size, (B, T), generator=gen) for _ in range(2))
    for sp, overlap in ((False, False), (True, True)):
        ref, model, _, mesh = _setup(world_size, sp, BASE, overlap=overlap)
        assert_bf16_products_in_fp32(ref, model, vocab_parallel_loss(mesh["tp"], BASE.vocab_size), tokens, targets,
                                     f"sp={sp} overlap={overlap}")


def _tp2_all(rank: int, world_size: int, cases: list) -> dict:
    """One set of 2 ranks for every tp = 2 check (spawning ranks costs seconds)."""
    stats = [_compare_model(rank, world_size, *case) for case in cases]
    _compare_stages(rank, world_size)
    _frozen_after_first_backward(rank, world_size)
    _bf16_states_overlap(rank, world_size)
    _bf16_products_in_fp32(rank, world_size)
    return {"stats": stats, "dropout": _dropout_streams(rank, world_size)}


def _layer_cases(rank: int, world_size: int, cases: list) -> list[dict]:
    return [_compare_model(rank, world_size, *case) for case in cases]


@pytest.fixture(scope="module")
def tp2():
    """Rank 0's results of the tp = 2 checks (each rank asserts its own equalities)."""
    cases = [
        (False, {}),
        # SP, tied embedding and head, a vocabulary tp does not divide (shards of 255 and 254).
        (True, {"tie_embeddings": True, "vocab_size": 509}),
        # The same two with the overlapped region entry (parallel.tp_overlap).
        (False, {}, True),
        (True, {"tie_embeddings": True, "vocab_size": 509}, True),
    ]
    return run_ranks(2, _tp2_all, cases)[0]


def test_tp2_layers_and_pipeline_stages_match_single_device(tp2):
    # Plain TP: an all-reduce per embedding, per attention and MLP input (backward) and
    # output (forward), at the head's input, and the loss's max and (sum exp, target).
    plain = tp2["stats"][0]
    n_layers = BASE.n_layers
    assert set(plain) == {"all_reduce"} and plain["all_reduce"]["calls"] == 1 + 4 * n_layers + 1 + 2
    assert plain["all_reduce"]["peers"] == [1]
    act = B * T * BASE.dim * 4  # one fp32 activation (B, T, D)
    token = B * T * 4
    expected = 2 * (1 / 2) * (act * (2 + 4 * n_layers) + 3 * token)
    assert plain["all_reduce"]["bytes_sent"] == pytest.approx(expected)
    # SP: all-reduces of activations become all-gathers and reduce-scatters of the same
    # total; the norms' gains (2 per block + final) are all-reduced in backward.
    seq = tp2["stats"][1]
    assert seq["all_gather"]["calls"] == seq["reduce_scatter"]["calls"] == 1 + 4 * n_layers + 1
    assert seq["all_gather"]["bytes_sent"] == pytest.approx(act / 2 * (2 + 4 * n_layers))
    assert seq["all_reduce"]["calls"] == 2 + (2 * n_layers + 1)
    # Overlapping changes when the reductions run, not which: the same calls and bytes.
    assert tp2["stats"][2] == plain and tp2["stats"][3] == seq


def test_tp4_layers_match_single_device():
    cases = [
        # 4 ranks, 2 KV heads: each KV head shared by two ranks; uneven vocabulary; SP.
        (True, {"vocab_size": 510}),
        # One KV head (multi-query) on all four ranks; tied weights; plain TP; overlapped
        # entry (wq's weight gradient computed there, the shared wk / wv's as usual).
        (False, {"n_kv_heads": 1, "tie_embeddings": True}, True),
    ]
    run_ranks(4, _layer_cases, cases)


def _dropout_streams(rank: int, world_size: int) -> dict:
    """Masks of the embedding/residual dropout and a fingerprint of the attention core's stream."""
    from polytrain.distributed.collectives import all_gather
    from polytrain.distributed.tensor_parallel import vocab_parallel_loss

    results = {}
    for sp in (False, True):
        cfg = dataclasses.replace(BASE, dropout=0.5)
        fingerprints, masks = [], []

        def spy_on_core(model, fingerprints=fingerprints):  # before parallelize: runs in the core's stream
            core = model.layers["0"].attention.core

            def spy(*args):
                fingerprints.append(torch.rand(4))  # what the core's dropout draws from
                return core(*args)

            model.layers["0"].attention.core = spy

        _, model, ctx, mesh = _setup(world_size, sp, cfg, prepare=spy_on_core)
        for module in (model.dropout, model.layers["0"].feed_forward.dropout):
            module.register_forward_hook(lambda m, i, o, masks=masks: masks.append((o != 0).float()))
        tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
        model.train()
        logits = model(tokens)
        vocab_parallel_loss(mesh["tp"], cfg.vocab_size)(logits, tokens).backward()
        gathered = [all_gather(m[None], 0, ctx.group) for m in masks + [fingerprints[0]]]
        results[sp] = [bool(torch.equal(g[0], g[1])) for g in gathered]
    # Recomputation redraws the very same masks: checkpointed runs give the same gradients,
    # also with the overlapped entry, whose deferred weight gradients see the recomputation.
    plain = _dropout_gradients(world_size, "none")
    for mode, overlap in (("full", False), ("selective", False), ("full", True), ("selective", True)):
        for name, grad in _dropout_gradients(world_size, mode, overlap).items():
            torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=1e-7, msg=f"{mode}, {overlap=}: {name}")
    return results


def _dropout_gradients(world_size: int, checkpointing: str, overlap: bool = False) -> dict[str, torch.Tensor]:
    from polytrain.distributed.activation_checkpoint import apply_activation_checkpointing
    from polytrain.distributed.tensor_parallel import vocab_parallel_loss

    cfg = dataclasses.replace(BASE, dropout=0.3)
    _, model, _, mesh = _setup(world_size, True, cfg, overlap=overlap)
    apply_activation_checkpointing(model, checkpointing)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    vocab_parallel_loss(mesh["tp"], cfg.vocab_size)(model(tokens), tokens).backward()
    return {name: p.grad.to_local() for name, p in model.named_parameters()}


def test_dropout_masks_equal_where_replicated_independent_where_sharded_and_recomputed_alike(tp2):
    results = tp2["dropout"]
    # Plain TP: embedding and MLP-output masks equal on both ranks; attention heads differ.
    assert results[False] == [True, True, False]
    # SP: the residual stream holds different tokens per rank, so every mask differs.
    assert results[True] == [False, False, False]
