"""Tensor, sequence and pipeline parallelism for the whole model zoo against the single process.

Layer level (on spawned ranks, each comparing with its own single-device copy): logits,
loss (with unscored -100 targets) and every parameter's gradient of gpt2, internlm2,
bert and t5 under tp = 2, with and without SP. Trainer level: 10 fp32 steps of each
architecture at tp = 2 (and SP) and of the decoders at pp = 2 give the single-process
loss and gradient-norm trajectory within 1e-4 relative, and so does fine-tuning an
imported Hugging Face GPT-2 (4 steps) at tp = 2, tp = 2 with SP and pp = 2. Dropout
streams and the loss's handling of unscored targets are checked on 2 ranks too.
"""

from __future__ import annotations

import copy

import pytest
import torch

from polytrain.config import ModelConfig
from tests.multirank import run_ranks, tp_parallelize

pytestmark = pytest.mark.slow

B, T, S = 2, 16, 12  # batch, (decoder) sequence, t5 encoder sequence


def zoo_config(arch: str, **overrides) -> ModelConfig:
    """A tiny model of `arch` with its registry defaults (activation, tying, norms)."""
    from polytrain.models import ARCHITECTURES

    fields = dict(arch=arch, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=101,
                  max_seq_len=32)
    return ModelConfig(**{**fields, **ARCHITECTURES[arch].defaults, **overrides})


def _inputs(cfg: ModelConfig) -> tuple[tuple, torch.Tensor]:
    """(model inputs, targets (B, T) with unscored -100 entries) for this architecture."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets[0, ::3] = -100
    if cfg.arch == "bert":
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, -3:] = 0  # padding keys
        return (tokens, torch.randint(0, 2, (B, T), generator=g), mask), targets
    if cfg.arch == "t5":
        source = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, -2:] = 0
        return (source, tokens, mask), targets
    return (tokens,), targets


def _compare(rank: int, world_size: int, arch: str, sp: bool, overrides: dict) -> None:
    import torch.nn.functional as F

    from polytrain.distributed.collectives import gather_from_tp
    from polytrain.distributed.tensor_parallel import shard_sizes, vocab_parallel_loss
    from polytrain.distributed.topology import ParallelDims
    from polytrain.models import ARCHITECTURES
    from polytrain.models.common.init import init_plain

    cfg = zoo_config(arch, **overrides)
    what = f"{arch} tp={world_size} sp={sp} {overrides}"
    torch.manual_seed(0)
    ref = ARCHITECTURES[arch].build(cfg)
    init_plain(ref, 0)
    # tp_overlap as training runs it by default: T5's cross-attention enters two inputs at once.
    dims = ParallelDims(world_size=world_size, dp_replicate=1, dp_shard=1, zero=0, tp=world_size, sp=sp,
                        tp_overlap=True)
    model = copy.deepcopy(ref)
    ctx, mesh = tp_parallelize(model, dims)
    args, targets = _inputs(cfg)

    ref_logits = ref(*args)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()
    logits = model(*args)  # (B, T, V/tp)
    loss = vocab_parallel_loss(mesh["tp"], cfg.vocab_size)(logits, targets)
    loss.backward()

    sizes = shard_sizes(cfg.vocab_size, world_size)
    assert logits.shape[-1] == sizes[rank], what
    full = gather_from_tp(logits.detach(), -1, sizes, ctx.group)
    torch.testing.assert_close(full, ref_logits, rtol=1e-5, atol=1e-5, msg=what)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6, msg=what)
    ref_params = dict(ref.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(ref_params), "parameter names must not change"
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), ref_params[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=f"{what}: gradient of {name}")
    if ARCHITECTURES[arch].kind == "decoder":
        from polytrain.inference.generate import generate

        # KV-cached greedy decoding of prompts of different lengths (left-padded: per-row
        # positions) runs without SP and gathers the logits: the single-device tokens.
        prompts = [[5, 17, 3, 88, 42], [23, 4]]
        assert generate(model, prompts, 8, temperature=0) == generate(ref, prompts, 8, temperature=0), what


def _cases(rank: int, world_size: int, cases: list) -> None:
    for arch, sp, overrides in cases:
        _compare(rank, world_size, arch, sp, overrides)


@pytest.mark.parametrize("arch", ["gpt2", "internlm2", "bert", "t5"])
def test_tp2_layers_match_single_device(arch):
    cases = {
        # Biased columns and rows, LayerNorm gains and biases, learned positions (cut to
        # each rank's tokens under SP), a tied head over an uneven vocabulary (52 + 51 rows).
        "gpt2": [("gpt2", False, {}), ("gpt2", True, {"vocab_size": 103})],
        # Packed wqkv split by KV groups (2 groups of 2 query heads + k + v).
        "internlm2": [("internlm2", False, {"n_kv_heads": 2}),
                      ("internlm2", True, {"n_kv_heads": 2, "tie_embeddings": True})],
        # Token-type and position tables, post-norm, padding keys, the replicated MLM
        # transform and the tied head's vocabulary-split bias.
        "bert": [("bert", False, {}), ("bert", True, {"vocab_size": 103})],
        # v1.1 (gated GELU, untied) and v1.0 (ReLU, tied, output scaling); per-head bias
        # tables, cross-attention over a padded encoder input; SP on both streams.
        "t5": [("t5", False, {}), ("t5", True, {}),
               ("t5", True, {"activation": "relu", "gated_ffn": False, "tie_embeddings": True,
                             "output_scale": True, "vocab_size": 103})],
    }[arch]
    run_ranks(2, _cases, cases)


# ----- trainer level: the loss curve of 10 fp32 steps -----------------------------------

RTOL = 1e-4


def arch_overrides(corpus, run_dir, arch: str, *extra: str) -> list[str]:
    """A tiny `arch` run on the small corpus (seq_len 32: tp = 2 splits it under SP)."""
    from tests.conftest import tiny_overrides

    return tiny_overrides(corpus, run_dir, model__arch=arch, model__dim=32, model__n_layers=2,
                          model__n_heads=4, model__n_kv_heads=2 if arch == "internlm2" else 4,
                          model__ffn_dim=64, model__vocab_size=512, model__max_seq_len=64,
                          data__seq_len=32) + list(extra)


def check_layouts(corpus, tmp_path, arch: str, references: dict[str, list[str]],
                  layouts: dict[str, tuple[str, list[str]]], world_size: int = 2) -> None:
    """Train each reference on one process and each layout (reference name, extra overrides) on
    `world_size` ranks; every layout's loss and gradient-norm trajectory must be its reference's."""
    from tests.distributed.test_parity import (
        _train_layouts,
        assert_same_trajectory,
        train,
        train_rows,
    )

    rows = {}
    for name, extra in references.items():
        train(arch_overrides(corpus, tmp_path / name, arch, *extra))
        rows[name] = train_rows(tmp_path / name)
        assert len(rows[name]) == 10 and rows[name][-1]["loss"] < rows[name][0]["loss"], name
    runs = [arch_overrides(corpus, tmp_path / name, arch, *references[ref], *extra)
            for name, (ref, extra) in layouts.items()]
    run_ranks(world_size, _train_layouts, runs)
    for name, (ref, _) in layouts.items():
        assert_same_trajectory(rows[ref], train_rows(tmp_path / name), RTOL, f"{arch} {name}")


TP2 = ["--parallel.tp", "2"]
SP = ["--parallel.sp", "true"]
PP2 = ["--parallel.pp", "2"]


@pytest.mark.parametrize("arch", ["gpt2", "internlm2"])
def test_decoders_train_alike_at_tp2_sp_and_pp2(arch, small_corpus, tmp_path):
    # gpt2 ties its embeddings: at pp2 the last stage holds a copy of the token table.
    check_layouts(small_corpus, tmp_path, arch, {"ref": []}, {
        "tp2": ("ref", TP2),
        "tp2_sp": ("ref", TP2 + SP),
        "pp2": ("ref", PP2),
    })


def test_gpt2_composes_tp2_sp_with_pp2(small_corpus, tmp_path):
    # 4 ranks: the second stage receives each rank's (B, T/2, D) slice of the residual stream,
    # and each tp rank's vocabulary rows of the tied table's two copies are summed in pairs.
    check_layouts(small_corpus, tmp_path, "gpt2", {"ref": []}, {"tp2_sp_pp2": ("ref", TP2 + SP + PP2)},
                  world_size=4)


@pytest.mark.parametrize("arch", ["bert", "t5"])
def test_encoders_train_alike_at_tp2_and_sp(arch, small_corpus, tmp_path):
    # t5: 33-token windows give span corruption's encoder 30 and decoder 8 tokens, both split by SP.
    seq = ["--data.seq_len", "33"] if arch == "t5" else []
    check_layouts(small_corpus, tmp_path, arch, {"ref": seq}, {"tp2": ("ref", TP2), "tp2_sp": ("ref", TP2 + SP)})


# ----- dropout streams -------------------------------------------------------------------


def _dropout(rank: int, world_size: int, archs: list[str]) -> None:
    """With dropout under tp (no SP): the replicated residual stream stays identical on every
    rank, so every block's output does, while the attention core (this rank's heads) draws
    from a per-rank stream; and dropout acts at all (training != eval)."""
    from polytrain.distributed.collectives import all_gather
    from polytrain.distributed.tensor_parallel import vocab_parallel_loss
    from polytrain.distributed.topology import ParallelDims
    from polytrain.models import ARCHITECTURES
    from polytrain.models.common.init import init_plain

    def same_across_tp(x: torch.Tensor) -> bool:
        copies = all_gather(x.detach()[None].contiguous(), 0, ctx.group)  # (tp, ...)
        return torch.equal(copies[0], copies[1])

    for arch in archs:
        cfg = zoo_config(arch, dropout=0.3)
        torch.manual_seed(0)  # every rank's default generator in lock-step, as the trainer's
        model = ARCHITECTURES[arch].build(cfg)
        init_plain(model, 0)
        attention, core_draws = model.layers["0"].attention, []
        inner_core = attention.core

        def spy(*args, inner_core=inner_core, core_draws=core_draws):
            core_draws.append(torch.rand(4))  # what the core's dropout draws from
            return inner_core(*args)

        attention.core = spy  # before parallelize, which runs it in the per-rank stream
        dims = ParallelDims(world_size=world_size, dp_replicate=1, dp_shard=1, zero=0, tp=world_size, sp=False)
        ctx, mesh = tp_parallelize(model, dims)
        args, targets = _inputs(cfg)
        outs = []
        hooks = [b.register_forward_hook(lambda m, i, o, outs=outs: outs.append(o)) for b in model.layers.values()]
        logits = model(*args)
        vocab_parallel_loss(mesh["tp"], cfg.vocab_size)(logits, targets).backward()
        for h in hooks:
            h.remove()
        for i, out in enumerate(outs):
            assert same_across_tp(out), f"{arch}: block {i}'s replicated output differs across tp"
        assert not same_across_tp(core_draws[0]), f"{arch}: the attention core's stream is shared across tp"
        model.eval()
        with torch.no_grad():
            assert not torch.allclose(model(*args), logits.detach()), f"{arch}: dropout had no effect"


def _cross_entropy_ignores(rank: int, world_size: int) -> None:
    """The vocabulary-parallel loss of targets with -100 entries equals F.cross_entropy's (the
    mean over scored tokens), and so does the gradient of every rank's logits; NaN when none is scored.
    Per-token log-probabilities equal log_softmax's, gradients too."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from polytrain.distributed.tensor_parallel import shard_range, vocab_parallel_cross_entropy

    V = 11  # split 6 + 5
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, V, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (2, 6), generator=g)
    targets[0, 1:5] = -100
    targets[1, 0] = -100
    start, end = shard_range(V, world_size, rank)
    local = logits.detach()[..., start:end].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, start, dist.group.WORLD)
    loss.backward()
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(local.grad, logits.grad[..., start:end])
    none = torch.full_like(targets, -100)
    assert vocab_parallel_cross_entropy(local, none, start, dist.group.WORLD).isnan()
    # Per-token log-probabilities (RLHF's): values and gradients of a weighted sum, as log_softmax's.
    from polytrain.distributed.tensor_parallel import vocab_parallel_token_logprobs

    sampled = torch.randint(0, V, (2, 6), generator=g)
    weights = torch.randn(2, 6, generator=g)
    local.grad, logits.grad = None, None
    logp = vocab_parallel_token_logprobs(local, sampled, start, dist.group.WORLD)
    (logp * weights).sum().backward()
    ref_logp = F.log_softmax(logits, -1).gather(-1, sampled[..., None])[..., 0]
    (ref_logp * weights).sum().backward()
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(local.grad, logits.grad[..., start:end])


def _dropout_and_loss(rank: int, world_size: int, archs: list[str]) -> None:
    _dropout(rank, world_size, archs)
    _cross_entropy_ignores(rank, world_size)


def test_dropout_streams_and_loss_ignoring_unscored_targets_under_tp():
    run_ranks(2, _dropout_and_loss, ["gpt2", "internlm2", "bert", "t5"])


# ----- fine-tuning an imported Hugging Face model ----------------------------------------


def test_imported_gpt2_fine_tunes_alike_at_tp2_and_pp2(small_corpus, tmp_path):
    from tests.distributed.test_finetune_imported import fine_tune_imported_gpt2
    from tests.distributed.test_parity import _train_layouts, assert_same_trajectory, train_rows

    # Tied, as Hugging Face's gpt2: the pp2 head starts from the imported token table.
    overrides, reference = fine_tune_imported_gpt2(small_corpus, tmp_path, tied=True)
    layouts = {"tp2": TP2, "tp2_sp": TP2 + SP, "pp2": PP2}
    run_ranks(2, _train_layouts, [overrides(name, *extra) for name, extra in layouts.items()])
    for name in layouts:
        assert_same_trajectory(reference, train_rows(tmp_path / name), RTOL, f"{name} from the imported gpt2")
