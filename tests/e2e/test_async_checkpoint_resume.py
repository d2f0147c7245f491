"""A checkpoint saved asynchronously holds what a synchronous save of the same step holds, and
resuming from it continues the run exactly; the data come from a Parquet file, so this is also
the resume-at-the-exact-sample check of that source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, rows_after, train, train_rows

pytestmark = pytest.mark.slow
pa = pytest.importorskip("pyarrow", reason="pyarrow (polytrain[datasets]) reads the .parquet source")
import pyarrow.parquet as pq  # noqa: E402


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint by its flattened name, sized from DCP's metadata and loaded by DCP."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def same(a, b) -> bool:
    """Equal nested values, tensors compared exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_async_save_equals_sync_save_and_resumes(small_corpus, tmp_path):
    parquet = tmp_path / "small.parquet"
    texts = [json.loads(line)["text"] for line in small_corpus.read_text().splitlines()]
    pq.write_table(pa.table({"content": texts}), parquet, row_group_size=4)

    def run(run_dir: Path, steps: int, async_save: bool) -> None:
        train(tiny_overrides(parquet, run_dir, run__steps=steps, checkpoint__every=10, checkpoint__keep=0,
                             checkpoint__async_save=async_save, data__text_field="content",
                             train__min_lr=3e-3))  # = lr: no decay, so a shorter run has the same schedule

    run(tmp_path / "async", 20, True)
    run(tmp_path / "sync", 11, False)  # past 10: its step-10 save is inside the loop, as the async run's
    async_10, sync_10 = (tmp_path / d / "checkpoints" / "step_10" for d in ("async", "sync"))
    assert (async_10 / "trainer.json").read_bytes() == (sync_10 / "trainer.json").read_bytes()
    # torch.save's archive holds a random serialization id: compare what it loads. Not torch's CPU
    # generator: the first run in this process drew from it to time the host's peak FLOP/s
    # (backend/flops.py), the second read the peak from memory.
    rng = [torch.load(d / "rng" / "rank_0.pt", weights_only=False) for d in (async_10, sync_10)]
    assert same({**rng[0], "torch": None}, {**rng[1], "torch": None})
    got, expected = checkpoint_tensors(async_10), checkpoint_tensors(sync_10)
    assert sorted(got) == sorted(expected) and len(got) > 10
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(async_10, resumed / "checkpoints" / "step_10")
    run(resumed, 20, True)
    assert [r["step"] for r in train_rows(resumed)] == list(range(11, 21))
    assert_same_trajectory(rows_after(tmp_path / "async", 10), train_rows(resumed), 1e-6, "resumed from async")
