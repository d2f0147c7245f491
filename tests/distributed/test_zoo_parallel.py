"""Tensor, sequence and pipeline parallelism for the whole model zoo against the single process.

Layer level (on spawned ranks, each comparing with its own single-device copy): logits,
loss (with unscored -100 targets) and every parameter's gradient of gpt2, internlm2,
bert and t5 under tp = 2, with and without SP. Trainer level: 10 fp32 steps of each
architecture at tp = 2 (and SP) and of the decoders at pp = 2 give the single-process
loss and gradient-norm trajectory within 1e-4 relative, and so does fine-tuning an
imported Hugging Face GPT-2.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from polytrain.config import ModelConfig
from tests.multirank import run_ranks

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
    dims = ParallelDims(world_size=world_size, dp_replicate=1, dp_shard=1, zero=0, tp=world_size, sp=sp)
    mesh = dims.build_mesh("cpu")
    model = copy.deepcopy(ref)
    ctx = ARCHITECTURES[arch].parallelize(model, dims, mesh)
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


def _cases(rank: int, world_size: int, cases: list) -> None:
    for arch, sp, overrides in cases:
        _compare(rank, world_size, arch, sp, overrides)


@pytest.mark.parametrize("arch", ["gpt2", "internlm2"])
def test_tp2_layers_match_single_device(arch):
    cases = {
        # Biased columns and rows, LayerNorm gains and biases, learned positions (cut to
        # each rank's tokens under SP), a tied head over an uneven vocabulary (52 + 51 rows).
        "gpt2": [("gpt2", False, {}), ("gpt2", True, {"vocab_size": 103})],
        # Packed wqkv split by KV groups (2 groups of 2 query heads + k + v).
        "internlm2": [("internlm2", False, {"n_kv_heads": 2}),
                      ("internlm2", True, {"n_kv_heads": 2, "tie_embeddings": True})],
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
                  layouts: dict[str, tuple[str, list[str]]]) -> None:
    """Train each reference on one process and each layout (reference name, extra overrides) on
    2 ranks; every layout's loss and gradient-norm trajectory must be its reference's."""
    from tests.distributed.test_parity import _train_layouts, assert_same_trajectory, train, train_rows

    rows = {}
    for name, extra in references.items():
        train(arch_overrides(corpus, tmp_path / name, arch, *extra))
        rows[name] = train_rows(tmp_path / name)
        assert len(rows[name]) == 10 and rows[name][-1]["loss"] < rows[name][0]["loss"], name
    run_ranks(2, _train_layouts, [arch_overrides(corpus, tmp_path / name, arch, *references[ref], *extra)
                                  for name, (ref, extra) in layouts.items()])
    for name, (ref, _) in layouts.items():
        assert_same_trajectory(rows[ref], train_rows(tmp_path / name), RTOL, f"{arch} {name}")


TP2 = ["--parallel.tp", "2"]
SP = ["--parallel.sp", "true"]
PP2 = ["--parallel.pp", "2"]
UNTIED = ["--model.tie_embeddings", "false"]  # a pipeline's first and last stage cannot share a weight


@pytest.mark.parametrize("arch", ["gpt2", "internlm2"])
def test_decoders_train_alike_at_tp2_sp_and_pp2(arch, small_corpus, tmp_path):
    references = {"ref": [], "ref_untied": UNTIED} if arch == "gpt2" else {"ref": []}
    untied = "ref_untied" if arch == "gpt2" else "ref"
    check_layouts(small_corpus, tmp_path, arch, references, {
        "tp2": ("ref", TP2),
        "tp2_sp": ("ref", TP2 + SP),
        "pp2": (untied, PP2),
    })
