"""Context-parallel training reproduces the single-process run: 10 steps, same seed and data.

One launch of 4 gloo ranks trains six layouts in turn: cp 4 as ring, Ulysses and hybrid
2 x 2 on packed documents (attention kept inside each document, positions restarting), and
cp 2 composed with dp 2 + ZeRO-3 (ring, selective recomputation), with tp 2 + sequence
parallelism (Ulysses, full recomputation) and with pp 2 (ring). Each must give the
single process's loss and gradient-norm trajectory within 1e-4 relative (the causal
triangle makes the zigzag shards' work uneven in position but equal per rank). The
reference for the packed runs is the single process with packed documents (its blockwise
attention equals SDPA with the dense document mask: tests/unit/test_packed_documents.py).
"""

from __future__ import annotations

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import _train_layouts, assert_same_trajectory, train, train_rows
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
RTOL = 1e-4
BASE = dict(train__global_batch_size=4)  # 2 micro-batches of 2 x 64 tokens per step
PACKED = dict(data__packed_documents=True)
LAYOUTS = {
    "ring4_packed": dict(parallel__cp=4, **PACKED),
    "ulysses4_packed": dict(parallel__cp=4, parallel__cp_mode="ulysses", **PACKED),
    "hybrid2x2_packed": dict(parallel__cp=4, parallel__cp_mode="hybrid", parallel__cp_ulysses=2, **PACKED),
    "ring2_dp2_zero3_selective": dict(parallel__cp=2, parallel__zero=3, train__activation_checkpoint="selective"),
    "ulysses2_tp2_sp_full": dict(parallel__cp=2, parallel__cp_mode="ulysses", parallel__tp=2, parallel__sp=True,
                                 train__activation_checkpoint="full"),
    "ring2_pp2": dict(parallel__cp=2, parallel__pp=2),
}


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_training")
    for name, extra in (("reference", {}), ("reference_packed", PACKED)):
        train(tiny_overrides(small_corpus, root / name, **BASE, **extra))
    run_ranks(4, _train_layouts, [tiny_overrides(small_corpus, root / name, **BASE, **extra)
                                  for name, extra in LAYOUTS.items()])
    return root


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layout_matches_single_process(runs, name):
    reference = train_rows(runs / ("reference_packed" if "packed" in name else "reference"))
    assert len(reference) == 10 and reference[-1]["loss"] < reference[0]["loss"]
    assert_same_trajectory(reference, train_rows(runs / name), RTOL, name)


def test_packed_documents_change_the_loss(runs):
    """The document mask is in effect: packed and plain single-process runs differ."""
    plain, packed = train_rows(runs / "reference"), train_rows(runs / "reference_packed")
    assert abs(plain[-1]["loss"] - packed[-1]["loss"]) > 1e-4
