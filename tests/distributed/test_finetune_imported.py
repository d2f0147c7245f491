"""Fine-tuning an imported Hugging Face model at another layout (ZeRO-3 and ZeRO-2 over 2 ranks)
reproduces the single-process fine-tune: the weights-only checkpoint reshards like any other."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from polytrain.convert import import_hf
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import _train_layouts, assert_same_trajectory, train, train_rows
from tests.models import hf_models
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow


def fine_tune_imported_gpt2(corpus, tmp_path, tied: bool = True) -> tuple[Callable[..., list[str]], list[dict]]:
    """Import a random HF GPT-2 and fine-tune it 4 steps on one process.

    Returns overrides(name, *extra) for more runs from the same import, and the
    single-process run's rows (checked to start far below a fresh model's loss).
    """
    hf = hf_models.gpt2(vocab_size=512, tie_word_embeddings=tied)
    with torch.no_grad():  # peaked logits: the imported model's loss is far from a fresh model's ln(512)
        (hf.transformer.wte if tied else hf.lm_head).weight.mul_(20)
    imported = import_hf(hf_models.save(hf, tmp_path / "hf"), tmp_path / "run")
    step_0 = str(imported / "checkpoints" / "step_0")

    def overrides(name: str, *extra: str) -> list[str]:
        args = tiny_overrides(corpus, tmp_path / name, run__steps=4, model__arch="gpt2",
                              model__dim=32, model__n_layers=2, model__n_heads=4, model__n_kv_heads=4,
                              model__ffn_dim=128, model__vocab_size=512, model__max_seq_len=64,
                              model__tie_embeddings=tied, data__seq_len=32, checkpoint__resume=step_0)
        return args + list(extra)

    train(overrides("single"))
    reference = train_rows(tmp_path / "single")
    fresh = overrides("fresh", "--checkpoint.resume", "none", "--run.steps", "1")
    train(fresh)
    assert train_rows(tmp_path / "fresh")[0]["loss"] < reference[0]["loss"] - 1.0
    return overrides, reference


def test_imported_model_fine_tunes_alike_at_every_layout(small_corpus, tmp_path):
    overrides, reference = fine_tune_imported_gpt2(small_corpus, tmp_path)
    layouts = {"zero3": ["--parallel.zero", "3"], "zero2": ["--parallel.zero", "2"]}
    run_ranks(2, _train_layouts, [overrides(name, *extra) for name, extra in layouts.items()])
    for name in layouts:
        assert_same_trajectory(reference, train_rows(tmp_path / name), 1e-5, f"{name} from the imported model")


def test_fine_tuning_starts_adam_at_step_0(small_corpus, tmp_path):
    """The first update from imported weights is a fresh AdamW's: bias-corrected as t = 1, where
    m_hat = g and v_hat = g^2, so (without weight decay) every element moves by lr * |g| / (|g| + eps),
    i.e. by lr. An optimizer whose state was created by a zero-lr step moves by 0.74 lr (t = 2)."""
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    imported = import_hf(hf_models.save(hf_models.gpt2(vocab_size=512), tmp_path / "hf"), tmp_path / "run")
    overrides = tiny_overrides(small_corpus, tmp_path / "tune", model__arch="gpt2", model__dim=32,
                               model__n_layers=2, model__n_heads=4, model__n_kv_heads=4, model__ffn_dim=128,
                               model__vocab_size=512, model__max_seq_len=64, model__tie_embeddings=True,
                               data__seq_len=32, train__weight_decay=0.0, train__grad_clip=0.0,
                               checkpoint__resume=imported / "checkpoints" / "step_0")
    trainer = Trainer(load_config(None, overrides))
    assert {float(s["step"]) for s in trainer.optimizer.state.values()} <= {0.0}
    before = [p.detach().clone() for p in trainer.model.parameters()]
    lr = trainer.train_step()["lr"]
    moved = torch.cat([(b - p.detach()).abs().flatten() / lr for b, p in zip(before, trainer.model.parameters())])
    assert moved.median().item() == pytest.approx(1.0, abs=1e-3)
    assert {float(s["step"]) for s in trainer.optimizer.state.values()} == {1.0}
    trainer.close()
