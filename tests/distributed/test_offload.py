"""ZeRO-1/2 optimizer-state offload: cpu and nvme keep no-offload's math; nvme's state lives in files."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from polytrain.config import load_config
from polytrain.errors import ConfigError
from polytrain.train.startup import plan_layout
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import (
    RTOL,
    assert_same_trajectory,
    rows_after,
    train,
    train_rows,
)
from tests.distributed.test_zero12 import (
    SMALL_BUCKET_MB,
    assert_same_weights,
    final_weights,
    resume_from_step_10,
    twenty_steps,
)
from tests.multirank import run_ranks

SAME_MATH = 1e-6  # offload moves tensors, not arithmetic


def _train_runs(rank: int, world_size: int, runs: list[list[str]]) -> None:
    for overrides in runs:
        train(overrides)


def _offload(run_dir: Path, mode: str, *extra: str) -> list[str]:
    return ["--parallel.offload", mode, "--parallel.nvme_path", str(run_dir / "nvme"), *extra]


@pytest.mark.slow
def test_offload_trains_like_no_offload(small_corpus, tmp_path):
    # AdamW at both stages; SGD's momentum buffer once (the only other state nvme maps).
    layouts = [(stage, mode, "adamw") for stage in (1, 2) for mode in ("none", "cpu", "nvme")]
    layouts += [(1, "none", "sgd"), (1, "nvme", "sgd")]
    runs = [tiny_overrides(small_corpus, tmp_path / f"zero{stage}_{mode}_{opt}", parallel__zero=stage,
                           train__optimizer=opt) + _offload(tmp_path, mode) for stage, mode, opt in layouts]
    run_ranks(2, _train_runs, runs)
    for stage, mode, opt in layouts:
        if mode != "none":
            ref, got = tmp_path / f"zero{stage}_none_{opt}", tmp_path / f"zero{stage}_{mode}_{opt}"
            what = f"zero{stage} {opt} {mode} offload at 2 ranks"
            assert len(train_rows(ref)) == 10
            assert_same_trajectory(train_rows(ref), train_rows(got), SAME_MATH, what)
            assert_same_weights(final_weights(ref), final_weights(got), what)


@pytest.mark.slow
def test_offload_on_one_rank_matches_the_plain_optimizer(small_corpus, tmp_path):
    # One data-parallel rank: no mesh, no collectives, but the same host-side masters and state.
    train(tiny_overrides(small_corpus, tmp_path / "plain"))
    for mode in ("cpu", "nvme"):
        train(tiny_overrides(small_corpus, tmp_path / mode, parallel__zero=2) + _offload(tmp_path, mode))
        got = train_rows(tmp_path / mode)
        assert_same_trajectory(train_rows(tmp_path / "plain"), got, RTOL, f"{mode} offload at 1 rank")


def _read_f32(path: Path) -> torch.Tensor:
    # Read through the page cache (not a second mapping): what the file holds now.
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)


def _nvme_probe(rank: int, world_size: int, corpus: Path, run_dir: Path) -> dict:
    """One step with nvme offload and one without; compare the files with both optimizers' state."""
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    def trainer(name: str, *extra: str) -> Trainer:
        overrides = tiny_overrides(corpus, run_dir / name, parallel__zero=2,
                                   parallel__reduce_bucket_mb=SMALL_BUCKET_MB) + list(extra)
        return Trainer(load_config(None, overrides))

    mapped, plain = trainer("nvme", *_offload(run_dir, "nvme")), trainer("plain")
    mapped.train_step()
    plain.train_step()
    zero, files = mapped.dp, mapped.dp.store.files()
    names = [f"rank{rank}_bucket{i}_{kind}.f32" for i in range(len(zero.buckets))
             for kind in ("exp_avg", "exp_avg_sq", "master")]
    checked = 0
    for index, bucket in enumerate(zero.buckets):
        on_disk = {kind: _read_f32(files[0].parent / f"rank{rank}_bucket{index}_{kind}.f32")
                   for kind in ("master", "exp_avg", "exp_avg_sq")}  # each (S,)
        assert torch.equal(on_disk["master"], bucket.master)
        for slot in bucket.slots:
            span = slice(slot.offset, slot.offset + slot.rows * slot.row)
            state = zero.optimizer.state[zero.masters[slot.fqn]]
            memory = plain.dp.optimizer.state[plain.dp.masters[slot.fqn]]
            assert state["step"].item() == memory["step"].item() == 1
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(on_disk[kind][span], state[kind].flatten()), (slot.fqn, kind)
                assert torch.equal(on_disk[kind][span], memory[kind].flatten()), (slot.fqn, kind)
                checked += bool(on_disk[kind][span].any())
    out = {"dir": str(files[0].parent), "names": [f.name for f in files], "expected_names": sorted(names),
           "sizes": {f.name: f.stat().st_size for f in files}, "bucket_sizes": [b.size for b in zero.buckets],
           "numel": sum(p.numel() for p in mapped.model.parameters()), "nonzero_state_views": checked}
    zero.close()
    out["removed"] = not Path(out["dir"]).exists()
    return out


@pytest.mark.slow
def test_nvme_state_lives_in_per_rank_files(small_corpus, tmp_path):
    world_size = 2
    probes = run_ranks(world_size, _nvme_probe, small_corpus, tmp_path)
    for rank, probe in enumerate(probes):
        store_dir = Path(probe["dir"])
        assert store_dir.parent == tmp_path / "nvme" and store_dir.name.startswith(f"rank{rank}-")
        assert probe["names"] == probe["expected_names"] and len(probe["bucket_sizes"]) > 4
        for index, size in enumerate(probe["bucket_sizes"]):
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert probe["sizes"][f"rank{rank}_bucket{index}_{kind}.f32"] == size * 4
        # params / dp fp32 values for each of: master, exp_avg, exp_avg_sq.
        assert sum(probe["sizes"].values()) == probe["numel"] // world_size * 4 * 3
        assert probe["nonzero_state_views"] > 0 and probe["removed"]


@pytest.mark.slow
def test_checkpoints_move_between_nvme_and_no_offload(small_corpus, tmp_path):
    nvme, plain = tmp_path / "nvme", tmp_path / "plain"
    nvme_to_plain, plain_to_nvme = tmp_path / "nvme_to_plain", tmp_path / "plain_to_nvme"
    nvme_to_one = tmp_path / "nvme_to_one_process"
    run_ranks(2, _train_runs, [
        twenty_steps(small_corpus, nvme, "--parallel.zero", "2", *_offload(tmp_path, "nvme")),
        twenty_steps(small_corpus, plain, "--parallel.zero", "2"),
    ])
    for source, target in ((nvme, nvme_to_plain), (plain, plain_to_nvme), (nvme, nvme_to_one)):
        resume_from_step_10(source, target)
    run_ranks(2, _train_runs, [twenty_steps(small_corpus, nvme_to_plain, "--parallel.zero", "2"),
                               twenty_steps(small_corpus, plain_to_nvme, "--parallel.zero", "1",
                                            *_offload(tmp_path, "nvme"))])
    train(twenty_steps(small_corpus, nvme_to_one))

    assert [r["step"] for r in train_rows(nvme_to_plain)] == list(range(11, 21))
    assert_same_trajectory(train_rows(plain), train_rows(nvme), SAME_MATH, "nvme vs none, 20 steps")
    assert_same_trajectory(rows_after(nvme, 10), train_rows(nvme_to_plain), SAME_MATH, "nvme -> none")
    assert_same_trajectory(rows_after(plain, 10), train_rows(plain_to_nvme), SAME_MATH, "none zero2 -> nvme zero1")
    assert_same_trajectory(rows_after(nvme, 10), train_rows(nvme_to_one), RTOL, "nvme 2 ranks -> 1 process")
    assert_same_weights(final_weights(plain), final_weights(plain_to_nvme), "none zero2 -> nvme zero1")


@pytest.mark.parametrize("args, message", [
    (["--parallel.zero", "0", "--parallel.offload", "cpu"], "parallel.offload = 'cpu' moves ZeRO's sharded"),
    (["--parallel.zero", "2", "--parallel.offload_params", "nvme"],
     "parallel.offload_params = 'nvme' needs parallel.zero = 3 (sharded parameters), not 2"),
    (["--parallel.zero", "3", "--parallel.offload", "cpu", "--parallel.offload_params", "nvme"],
     "give both the same value, or set one to 'none'"),
    (["--parallel.zero", "3", "--parallel.offload_params", "cpu", "--parallel.tp", "2"],
     "ZeRO-3 offload runs over data parallelism only; set parallel.tp = 1"),
    (["--parallel.zero", "3", "--parallel.offload_params", "nvme", "--train.precision", "fp16"],
     "use train.precision = bf16"),
    (["--train.autocast_only", "true"], "train.autocast_only applies to train.precision bf16 or fp16"),
])
def test_offload_and_precision_keys_are_checked(args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, args)


def test_zero3_offload_needs_two_shard_ranks():
    cfg = load_config(None, ["--parallel.zero", "3", "--parallel.offload", "nvme"])
    with pytest.raises(ConfigError, match=re.escape("over 1 rank(s) (parallel.zero_shard); it needs at least 2")):
        plan_layout(cfg, 1)
    assert plan_layout(cfg, 2).dims.dp_shard == 2


def test_nvme_path_must_be_a_writable_directory(tmp_path):
    (tmp_path / "a_file").write_text("")
    cfg = load_config(None, ["--parallel.zero", "2", "--parallel.offload", "nvme",
                             "--parallel.nvme_path", str(tmp_path / "a_file" / "offload")])
    with pytest.raises(ConfigError, match=r"parallel.nvme_path = .*a_file is not a directory"):
        plan_layout(cfg, 2)
    cfg.parallel.nvme_path = str(tmp_path / "new" / "dir")  # created at start-up
    assert plan_layout(cfg, 2).dims.dp == 2


def test_nvme_path_must_be_writable(tmp_path):
    """The check tries to create a file, so it holds for root too (CI runs as root): procfs
    refuses new files to every user; a read-only directory refuses all but root."""
    unwritable = [Path("/proc/self")]
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() != 0:
        unwritable.append(locked)
    for directory in unwritable:
        cfg = load_config(None, ["--parallel.zero", "1", "--parallel.offload", "nvme",
                                 "--parallel.nvme_path", str(directory / "offload")])
        with pytest.raises(ConfigError, match=rf"parallel.nvme_path = .*{directory} is not writable"):
            plan_layout(cfg, 2)
    if os.geteuid() == 0:  # root may write where the bits say no: the check must let it
        cfg.parallel.nvme_path = str(locked / "offload")
        assert plan_layout(cfg, 2).dims.dp == 2
