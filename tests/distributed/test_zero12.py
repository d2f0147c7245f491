"""ZeRO-1/2 reproduce the single-process run, really shard, and checkpoint across layouts."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import (
    RTOL,
    assert_same_trajectory,
    rows_after,
    train,
    train_rows,
)
from tests.multirank import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed
from benchmarks.zero_memory_comm import expected_comm  # noqa: E402

pytestmark = pytest.mark.slow
SMALL_BUCKET_MB = "0.03"  # ~31 KB of gradients: the tiny model's 0.56 MB splits into many buckets


def _trainer(overrides: list[str]):
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    return Trainer(load_config(None, overrides))


def _train_and_count(rank: int, world_size: int, layouts: dict[str, list[str]]) -> dict[str, dict]:
    """Train each layout; report its collectives and bucket layout."""
    import benchmarks.zero_memory_comm as counting  # noqa: PLC0415 (the repo root is on sys.path)
    from polytrain.distributed.reduce_scatter import buffers_sent

    # Scalars (the loss, the gradient norm) stay "small"; a small last bucket counts with the model.
    counting.SMALL_COLLECTIVE = 256

    out = {}
    for name, overrides in layouts.items():
        trainer = _trainer(overrides)
        # An independent count of what goes on the wire: every c10d call of the training steps,
        # wrapped from outside (the strategy's own tally is checked against it below).
        wire, step = counting.CommCounter(), trainer.train_step

        def counted_step(step=step, wire=wire):
            with wire:
                return step()

        trainer.train_step = counted_step
        trainer.train()
        dp = trainer.dp
        out[name] = {"comm": dataclasses.asdict(dp.comm), "buckets": len(dp.buckets),
                     "padded": sum(b.size for b in dp.buckets) * world_size,
                     "accum": trainer.batch.accum_steps, "stage": dp.stage, "wire": wire.total("model"),
                     "reduce_psi": buffers_sent(dp.group, trainer.runtime.acc.reduce_scatter_by_all_reduce),
                     "choice": dp.bucket_choice}
    return out


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from polytrain.checkpoint.trainer_state import latest_checkpoint, load_model_weights
    from polytrain.config import load_config
    from polytrain.models import ARCHITECTURES

    cfg = load_config(run_dir / "config.toml")
    model = ARCHITECTURES[cfg.model.arch].build(cfg.model)
    load_model_weights(latest_checkpoint(run_dir), model)
    return model.state_dict()


def assert_same_weights(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=RTOL, atol=1e-6, msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref")
    train(tiny_overrides(small_corpus, run_dir))
    return run_dir


def test_single_process_zero2_is_a_plain_optimizer(reference, small_corpus, tmp_path):
    train(tiny_overrides(small_corpus, tmp_path, parallel__zero=2))
    assert_same_trajectory(train_rows(reference), train_rows(tmp_path), 1e-6, "zero2 on one process")


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero12_match_single_process(world_size, reference, small_corpus, tmp_path):
    layouts = {"zero1": ["--parallel.zero", "1"], "zero2": ["--parallel.zero", "2"],
               "zero2_small_buckets": ["--parallel.zero", "2", "--parallel.reduce_bucket_mb", SMALL_BUCKET_MB],
               "zero2_measured_buckets": ["--parallel.zero", "2", "--parallel.reduce_bucket_auto", "true"]}
    if world_size == 4:
        del layouts["zero2"], layouts["zero2_measured_buckets"]
        layouts["zero1_small_buckets"] = ["--parallel.zero", "1", "--parallel.reduce_bucket_mb", SMALL_BUCKET_MB]
    runs = {name: tiny_overrides(small_corpus, tmp_path / name) + extra for name, extra in layouts.items()}
    every_rank = run_ranks(world_size, _train_and_count, runs)
    counts = every_rank[0]
    if "zero2_measured_buckets" in runs:  # a collective decision: every rank plans the same buckets
        choices = [rank["zero2_measured_buckets"]["choice"] for rank in every_rank]
        assert choices[0] is not None and all(c == choices[0] for c in choices)
        assert choices[0].cost.latency_s >= 0 and choices[0].cost.bytes_per_s > 0
        assert all(rank[name]["choice"] is None for rank in every_rank for name in runs
                   if name != "zero2_measured_buckets")
    ref_rows, ref_weights = train_rows(reference), final_weights(reference)
    steps = len(ref_rows)
    n_params = sum(w.numel() for w in ref_weights.values())
    for name in runs:
        what = f"{name} at {world_size} ranks"
        assert_same_trajectory(ref_rows, train_rows(tmp_path / name), RTOL, what)
        assert_same_weights(ref_weights, final_weights(tmp_path / name), what)
        c = counts[name]
        # The tiny config: 2 micro-batches per rank at 2 ranks, 1 at 4 ranks.
        assert c["accum"] == {2: 2, 4: 1}[world_size]
        assert (c["buckets"] > 4) == ("small" in name), what
        # Stage 2 reduces every micro-batch, stage 1 once per step; each bucket's
        # reduce-scatter takes the full (dp x S) fp32 buffer, one per bucket.
        reductions = steps * (c["accum"] if c["stage"] == 2 else 1)
        assert c["padded"] == n_params  # every dim 0 of the tiny model splits evenly
        assert c["comm"]["reduce_scatter_calls"] == reductions * c["buckets"], what
        assert c["comm"]["reduce_scatter_bytes"] == reductions * n_params * 4, what
        assert c["comm"]["all_gather_bytes"] == steps * n_params * 4, what
        # Bytes sent on the wire, counted independently: ring collectives over fp32 buffers,
        # a reduce-scatter sent as an all-reduce where the accelerator says that is faster.
        per_step = expected_comm(c["stage"], world_size, c["accum"], n_params, 0, 4, c["reduce_psi"])
        assert c["wire"] == pytest.approx(steps * per_step, rel=1e-9), what


def _memory_probe(rank: int, world_size: int, corpus: Path, run_dir: Path) -> dict[str, dict]:
    """Per stage: local numel of optimizer state and master shards, and which full gradients remain."""
    out = {}
    for stage in (1, 2):
        trainer = _trainer(tiny_overrides(corpus, run_dir / str(stage), parallel__zero=stage,
                                          train__global_batch_size=16))
        trainer.train_step()  # creates the optimizer state
        state = [t for s in trainer.optimizer.state.values() for k, t in s.items() if k != "step"]
        local = {"state": sum(t.numel() for t in state),  # local shards: plain tensors
                 "masters": sum(m.numel() for m in trainer.dp.masters.values()),
                 "numel": sum(p.numel() for p in trainer.model.parameters()),
                 "tensors": len(list(trainer.model.parameters()))}
        indices = trainer.sampler.next_batch()[:2]
        trainer.dp.before_micro_batch(trainer.model, last=False)  # a micro-batch before the last
        trainer._loss(indices, trainer.train_data).backward()
        local["full_grads_left"] = sum(p.grad is not None for p in trainer.model.parameters())
        trainer.dp.before_micro_batch(trainer.model, last=True)  # stage 2 lands its reductions here
        local["grad_shard"] = sum(b.grad.numel() for b in trainer.dp.buckets if b.grad is not None)
        local["grad_shard_nonzero"] = any(b.grad is not None and bool(b.grad.any()) for b in trainer.dp.buckets)
        trainer.dp.clip_grad_norm_(1.0)  # finish the reductions before the next trainer
        out[stage] = local
    return out


def test_zero12_shard_state_and_gradients(small_corpus, tmp_path):
    world_size = 4
    results = run_ranks(world_size, _memory_probe, small_corpus, tmp_path)
    for rank, probe in enumerate(results):
        for stage, local in probe.items():
            n = local["numel"]
            # Adam's two moments, each 1/dp of the single-process ones; masters likewise.
            assert local["state"] == 2 * n // world_size, (rank, stage)
            assert local["masters"] == n // world_size, (rank, stage)
        # Stage 1 keeps accumulating full gradients until the last micro-batch (its gradient
        # shard does not exist yet); stage 2 reduced them into the shard during backward and
        # freed them.
        assert probe[1]["grad_shard"] == 0 and probe[2]["grad_shard"] == probe[2]["numel"] // world_size
        assert probe[1]["full_grads_left"] == probe[1]["tensors"] and not probe[1]["grad_shard_nonzero"]
        assert probe[2]["full_grads_left"] == 0 and probe[2]["grad_shard_nonzero"]


# ----- checkpoints across layouts ------------------------------------------------------------------


def twenty_steps(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return tiny_overrides(corpus, run_dir, run__steps=20, checkpoint__every=10, checkpoint__keep=0) + list(extra)


def resume_from_step_10(straight_dir: Path, resumed_dir: Path) -> None:
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight_dir / "checkpoints" / "step_10", resumed_dir / "checkpoints" / "step_10")


def _train_runs(rank: int, world_size: int, runs: list[list[str]]) -> None:
    for overrides in runs:
        train(overrides)


def test_checkpoints_move_between_zero12_and_one_process(small_corpus, tmp_path):
    single, zero2 = tmp_path / "single", tmp_path / "zero2x2"
    single_to_zero1, zero2_to_single = tmp_path / "single_to_zero1x2", tmp_path / "zero2x2_to_single"
    train(twenty_steps(small_corpus, single))
    resume_from_step_10(single, single_to_zero1)
    run_ranks(2, _train_runs, [twenty_steps(small_corpus, zero2, "--parallel.zero", "2"),
                               twenty_steps(small_corpus, single_to_zero1, "--parallel.zero", "1")])
    resume_from_step_10(zero2, zero2_to_single)
    train(twenty_steps(small_corpus, zero2_to_single))

    assert [r["step"] for r in train_rows(zero2_to_single)] == list(range(11, 21))
    assert_same_trajectory(rows_after(zero2, 10), train_rows(zero2_to_single), RTOL, "zero2 2 ranks -> 1 rank")
    assert_same_trajectory(rows_after(single, 10), train_rows(single_to_zero1), RTOL, "1 rank -> zero1 2 ranks")
    assert_same_weights(final_weights(single), final_weights(single_to_zero1), "1 rank -> zero1 2 ranks")
