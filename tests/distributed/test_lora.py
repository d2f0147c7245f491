"""LoRA adapters under every parallelism reproduce single-process LoRA training.

One reference run on one process (llama, adapters on every block Linear, base frozen), then
one two-rank launch trains the same run at dp 2 with ZeRO-3, dp 2 with ZeRO-2, tp 2 with
sequence parallelism and pp 2: the loss and gradient-norm trajectories must agree within
1e-4 relative, and so must the trained adapters in the final checkpoints, which hold only
the adapters (the base stays as the seed made it). The tp 2 run's step-5 checkpoint then
resumes on one process and continues the reference's trajectory, and the merged `--to hf`
export of the reference (seeded base + adapters) gives polytrain's logits in transformers.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    train(tiny_overrides(small_corpus, root / "reference", **LORA))
    run_ranks(2, _train_layouts, [tiny_overrides(small_corpus, root / name, **LORA, **extra)
                                  for name, extra in LAYOUTS.items()])
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
