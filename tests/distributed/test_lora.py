"""LoRA adapters under every parallelism reproduce single-process LoRA training.

One reference run on one process (llama, adapters on every block Linear, base frozen), then
one two-rank launch trains the same run at dp 2 with ZeRO-3, dp 2 with ZeRO-2, tp 2 with
sequence parallelism and pp 2: the loss and gradient-norm trajectories must agree within
1e-4 relative, and so must the trained adapters in the final checkpoints, which hold only
the adapters (the base stays as the seed made it). The tp 2 run's step-5 checkpoint then
resumes on one process and continues the reference's trajectory, and the merged `--to hf`
export of the reference (seeded base + adapters) gives polytrain's logits in transformers.

In the same launch, the two tensor-parallel LoRA layers against a LoRALinear on one rank in
float64 (outputs and every gradient): a column layer whose one unit is shared by both ranks
(a KV head at tp > n_kv_heads, with bias) and a row layer under sequence parallelism.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polytrain.checkpoint.consolidate import read_model_tensors
from polytrain.checkpoint.trainer_state import read_state
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import _train_layouts, assert_same_trajectory, rows_after, train, train_rows
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
RTOL = 1e-4
LORA = dict(lora__rank=4, lora__alpha=8, checkpoint__every=5, checkpoint__keep=0)
LAYOUTS = {
    "zero3": dict(parallel__zero=3),
    "zero2": dict(parallel__zero=2),
    "tp2_sp": dict(parallel__tp=2, parallel__sp=True),
    "pp2": dict(parallel__pp=2),
}


def _layer_errors() -> dict[str, float]:
    """Largest differences of the tp LoRA layers from a one-rank LoRALinear (float64), this rank's view."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from polytrain.distributed.tensor_parallel.context import TPContext
    from polytrain.distributed.tensor_parallel.lora import ColumnParallelLoRA, RowParallelLoRA
    from polytrain.lora import LoRALinear

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    g = torch.Generator().manual_seed(0)  # the same draws on both ranks

    def reference(out: int, inp: int) -> LoRALinear:
        layer = LoRALinear(nn.Linear(inp, out, dtype=torch.float64), rank=3, alpha=6.0)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        return layer

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    def compare(name: str, ref: LoRALinear, layer: nn.Module, errors: dict) -> None:
        for p in ("weight", "bias", "lora_a", "lora_b"):
            errors[f"{name} d{p}"] = (full(getattr(layer, p).grad) - getattr(ref, p).grad).abs().max().item()

    errors: dict[str, float] = {}
    # Column: 4 output rows = one unit, replicated on both ranks; each rank's loss uses it.
    ref = reference(4, 6)
    layer = ColumnParallelLoRA(reference(4, 6), TPContext(mesh, sp=False), unit=4, shared_units=True)
    with torch.no_grad():
        for p in ("weight", "bias", "lora_a", "lora_b"):
            getattr(layer, p).to_local().copy_(getattr(ref, p))
    x = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    dy = torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64)  # rank r's upstream gradient dy[r]
    (ref(x) * dy.sum(0)).sum().backward()
    y = layer(x)
    (y * dy[rank]).sum().backward()
    errors["column y"] = (y - ref(x)).abs().max().item()
    compare("column", ref, layer, errors)
    # Row under SP: input columns split, output tokens reduce-scattered (5 x 2 tokens over 2 ranks).
    ref = reference(4, 6)
    ctx = TPContext(mesh, sp=True)
    layer = RowParallelLoRA(reference(4, 6), ctx)
    with torch.no_grad():
        for p in ("weight", "bias", "lora_a", "lora_b"):
            local, whole = getattr(layer, p).to_local(), getattr(ref, p)
            local.copy_(whole[:, rank * 3:(rank + 1) * 3] if p in ("weight", "lora_a") else whole)
    x = torch.randn(2, 10, 6, generator=g, dtype=torch.float64)
    dy = torch.randn(2, 10, 4, generator=g, dtype=torch.float64)
    want = ref(x)
    (want * dy).sum().backward()
    mine = slice(rank * 5, (rank + 1) * 5)
    y = layer(x[..., rank * 3:(rank + 1) * 3])  # (2, 5, 4): this rank's tokens
    (y * dy[:, mine]).sum().backward()
    errors["row y"] = (y - want[:, mine]).abs().max().item()
    compare("row", ref, layer, errors)
    return errors


def _train_and_check_layers(rank: int, world_size: int, layouts: list[list[str]]) -> dict[str, float]:
    _train_layouts(rank, world_size, layouts)
    return _layer_errors()


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    train(tiny_overrides(small_corpus, root / "reference", **LORA))
    errors = run_ranks(2, _train_and_check_layers, [tiny_overrides(small_corpus, root / name, **LORA, **extra)
                                                    for name, extra in LAYOUTS.items()])
    (root / "layer_errors.json").write_text(json.dumps(errors))
    train(tiny_overrides(small_corpus, root / "resumed", **LORA,
                         checkpoint__resume=root / "tp2_sp" / "checkpoints" / "step_5"))
    return root


def test_reference_trains_only_the_adapters(runs):
    rows = train_rows(runs / "reference")
    assert len(rows) == 10 and rows[-1]["loss"] < rows[0]["loss"]
    final = runs / "reference" / "checkpoints" / "step_10"
    tensors = read_model_tensors(final)
    assert tensors and all(k.endswith((".lora_a", ".lora_b")) for k in tensors)
    assert len(tensors) == 2 * 2 * 7  # A and B of 7 Linear layers in each of 2 blocks
    assert any(t.abs().sum() > 0 for k, t in tensors.items() if k.endswith(".lora_b"))  # B moved off zero
    assert read_state(final).base == "init:7"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(runs, name):
    assert_same_trajectory(train_rows(runs / "reference"), train_rows(runs / name), RTOL, name)
    ref = read_model_tensors(runs / "reference" / "checkpoints" / "step_10")
    got = read_model_tensors(runs / name / "checkpoints" / "step_10")
    assert got.keys() == ref.keys(), name
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


def test_tp_layers_match_one_rank_in_float64(runs):
    errors = json.loads((runs / "layer_errors.json").read_text())
    assert len(errors) == 2 and len(errors[0]) == 10
    for rank_errors in errors:
        for what, error in rank_errors.items():
            assert error < 1e-12, what


def test_merged_export_gives_polytrains_logits(runs, tmp_path):
    import transformers

    import polytrain
    from polytrain.convert import export_hf

    model, tokenizer = polytrain.load(runs / "reference")  # the seeded base, the adapters merged in
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(runs / "reference", tmp_path / "hf")).eval()
    ids = torch.tensor([tokenizer.encode("import json\n")])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids), rtol=1e-5, atol=1e-5)


def test_tp_checkpoint_resumes_on_one_process(runs):
    resumed = train_rows(runs / "resumed")
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert_same_trajectory(rows_after(runs / "reference", 5), resumed, RTOL, "tp2+sp step 5 -> 1 process")
