"""`polytrain consolidate`: a checkpoint of any layout becomes one plain state dict a fresh model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polytrain.checkpoint.consolidate import consolidate
from polytrain.checkpoint.trainer_state import latest_checkpoint
from polytrain.cli import main
from polytrain.models.llama.model import Llama
from tests.conftest import tiny_overrides
from tests.e2e.test_errors import assert_one_line_error, run_cli
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
ZERO3 = ("--parallel.zero", "3")
TIED = ("--model.tie_embeddings", "true")


def overrides(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return tiny_overrides(corpus, run_dir, run__steps=2) + list(extra)


def train_in_process(args: list[str]):
    """The finished Trainer, whose single-process model holds the final weights."""
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, args))
    trainer.train()
    return trainer


def _train_layouts(rank: int, world_size: int, layouts: list[list[str]]) -> None:
    for args in layouts:
        train_in_process(args)


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory) -> dict:
    """Checkpoints of ZeRO-3 at 2 ranks and of one process (same seed), untied and tied."""
    root = tmp_path_factory.mktemp("consolidate")
    run_ranks(2, _train_layouts, [overrides(small_corpus, root / "zero3", *ZERO3),
                                  overrides(small_corpus, root / "zero3_tied", *ZERO3, *TIED)])
    single = train_in_process(overrides(small_corpus, root / "single"))
    single_tied = train_in_process(overrides(small_corpus, root / "single_tied", *TIED))
    return {"root": root, "single": single, "single_tied": single_tied,
            **{name: latest_checkpoint(root / name) for name in ("zero3", "zero3_tied")},
            "single_ckpt": latest_checkpoint(root / "single"),
            "single_tied_ckpt": latest_checkpoint(root / "single_tied")}


def fresh_model(trainer) -> Llama:
    return Llama(trainer.cfg.model).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.arange(16).reshape(2, 8) * 7 % 512
    with torch.no_grad():
        return model.eval()(tokens)


def test_zero3_and_single_process_give_the_trained_weights(runs, tmp_path):
    expected = runs["single"].model.state_dict()
    single = load_file(consolidate(runs["single_ckpt"], tmp_path / "single.safetensors"))
    zero3 = load_file(consolidate(runs["zero3"], tmp_path / "zero3.safetensors"))
    assert list(single) == list(zero3) == list(expected)
    assert "layers.0.attention.wq.weight" in single
    for name, value in expected.items():
        assert single[name].dtype == torch.float32
        assert torch.equal(single[name], value), name
        # Another layout sums in another order: the parity tolerance, not bitwise equality.
        torch.testing.assert_close(zero3[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_fresh_model_loads_the_file_strictly_and_gives_the_same_logits(runs, tmp_path):
    trained = runs["single"].model
    for ckpt in (runs["single_ckpt"], runs["zero3"]):
        model = fresh_model(runs["single"])
        model.load_state_dict(load_file(consolidate(ckpt, tmp_path)), strict=True)
        torch.testing.assert_close(logits(model), logits(trained), rtol=1e-5, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary left


def test_tied_embeddings_are_written_under_both_names(runs, tmp_path):
    trained = runs["single_tied"].model
    for ckpt in (runs["single_tied_ckpt"], runs["zero3_tied"]):
        weights = load_file(consolidate(ckpt, tmp_path / "tied.safetensors"))
        assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])
        model = fresh_model(runs["single_tied"])
        model.load_state_dict(weights, strict=True)
        assert model.output.weight is model.tok_embeddings.weight
        torch.testing.assert_close(logits(model), logits(trained), rtol=1e-5, atol=1e-5)


def test_bf16_and_pt_outputs(runs, tmp_path):
    expected = runs["single"].model.state_dict()
    bf16 = load_file(consolidate(runs["zero3"], tmp_path / "w.safetensors", dtype="bf16"))
    pt = torch.load(consolidate(runs["zero3"], tmp_path / "w.pt", dtype=torch.bfloat16), weights_only=True)
    for name, value in expected.items():
        assert bf16[name].dtype == pt[name].dtype == torch.bfloat16
        assert torch.equal(bf16[name], pt[name])
        torch.testing.assert_close(bf16[name], value.to(torch.bfloat16), rtol=1e-2, atol=1e-3)


def test_cli_writes_the_file(runs, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(runs["zero3"]), str(out), "--dtype", "fp16"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert {v.dtype for v in load_file(out).values()} == {torch.float16}


def test_errors_are_one_line(runs, capsys, tmp_path):
    ckpt, out = str(runs["zero3"]), str(tmp_path / "m.safetensors")
    code, err = run_cli(capsys, "consolidate", str(tmp_path), out)
    assert_one_line_error(code, err, "is not a polytrain checkpoint")
    code, err = run_cli(capsys, "consolidate", ckpt, str(tmp_path / "nope" / "m.safetensors"))
    assert_one_line_error(code, err, "output directory", "nope", "does not exist")
    code, err = run_cli(capsys, "consolidate", ckpt, out, "--dtype", "fp8")
    assert_one_line_error(code, err, "unknown dtype 'fp8'", "fp32, bf16, fp16")
    code, err = run_cli(capsys, "consolidate", ckpt, out, "--format", "npz")
    assert_one_line_error(code, err, "unknown format 'npz'")
    assert not any(tmp_path.iterdir())
