"""Compiled blocks and the chunked loss at 2 ranks, one launch: every layout trains as before.

- train.compile: ZeRO-2, ZeRO-3 with full recomputation, tp 2 with sequence parallelism and
  full recomputation, pp 2 with selective recomputation: losses and gradient norms of the
  compiled blocks equal eager's within 1e-5, with no graph break.
- the chunked loss under tp (vocabulary-parallel, chunked) and on a pipeline's last stage
  equals the plain path (whole local logits -> cross-entropy) within 1e-6.
Graphs are captured with the aot_eager backend here (dynamo and AOT autograd, the parts the
layouts touch; tests/unit/test_compile.py checks inductor's kernels on one process).
"""

from __future__ import annotations

from pathlib import Path

import torch

from polytrain.config import load_config
from tests.conftest import tiny_overrides
from tests.multirank import run_ranks

COMPILED = {
    "zero2": {"parallel.zero": 2},
    "zero3+full": {"parallel.zero": 3, "train.activation_checkpoint": "full"},
    "tp2+sp+full": {"parallel.tp": 2, "parallel.sp": True, "train.activation_checkpoint": "full"},
    "pp2+selective": {"parallel.pp": 2, "train.activation_checkpoint": "selective"},
}
PLAIN_LOSS = ("tp2+sp+full", "pp2+selective")  # also run with train.chunked_loss false


def _curve(corpus: str, run_dir: Path, extra: dict) -> list[tuple[float, float]]:
    from polytrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, tiny_overrides(Path(corpus), run_dir, **extra)))
    stats = [trainer.train_step() for _ in range(2)]
    curve = [(s["loss"], s["grad_norm"]) for s in stats] + [(trainer.evaluate(), 0.0)]
    breaks = trainer.compile_timer.breaks if trainer.compile_timer else 0
    trainer.close()
    return curve, breaks


def _body(rank: int, world_size: int, corpus: str, out: str) -> dict:
    from polytrain.train import compiled

    compiled.BACKEND = "aot_eager"
    results = {}
    for name, extra in COMPILED.items():
        runs = {"eager": {}, "compiled": {"train.compile": True}}
        if name in PLAIN_LOSS:
            runs["plain loss"] = {"train.chunked_loss": False}
        for run, more in runs.items():
            results[name, run] = _curve(corpus, Path(out) / f"{name}-{run}", {**extra, **more})
    return results


def test_compiled_blocks_and_the_chunked_loss_keep_every_layout_s_curve(small_corpus, tmp_path):
    for results in run_ranks(2, _body, str(small_corpus), str(tmp_path)):
        for name in COMPILED:
            eager, _ = results[name, "eager"]
            compiled, breaks = results[name, "compiled"]
            assert breaks == 0, name
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5, msg=name)
            if name in PLAIN_LOSS:  # the chunked loss (the default) against whole logits
                plain, _ = results[name, "plain loss"]
                torch.testing.assert_close(eager, plain, rtol=1e-6, atol=1e-6, msg=name)
