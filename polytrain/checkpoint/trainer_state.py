"""Resumable, layout-independent checkpoints with PyTorch Distributed Checkpoint (DCP).

    <run dir>/checkpoints/step_<N>/
        .metadata, __<rank>_0.distcp   # model + optimizer, keyed by parameter name (DCP)
        rng/rank_<r>.pt                # each rank's RNG states
        trainer.json                   # step (which fixes the lr schedule), sampler position, model config

A checkpoint is written by `write_checkpoint_dir` (directory.py): into `.tmp-step_<N>/`,
synced to disk and renamed once every rank has finished, with trainer.json written last;
a crash or a failure while saving leaves only a `.tmp-` directory, which is ignored and
cleared, so the previous checkpoint stays the newest complete one. DCP stores every
tensor by name with its global shape, so a checkpoint written at one data-parallel /
ZeRO layout loads at any other.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

from polytrain.checkpoint.directory import TMP_PREFIX, torch_bytes, write_checkpoint_dir
from polytrain.checkpoint.run_dir import RunDir
from polytrain.errors import CheckpointError

FORMAT = "polytrain-checkpoint-1"
STATE_FILE = "trainer.json"
# DCP warns on every single-process save/load that it assumes a single process: it does, by design.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Test hook: the rank that reaches this step's save kills itself mid-write (SIGKILL),
# as a power cut or OOM killer would.
_KILL_DURING_SAVE_ENV = "POLYTRAIN_TEST_KILL_DURING_SAVE"


@dataclass
class TrainerState:
    """What a checkpoint restores besides tensors."""

    step: int
    sampler: dict[str, Any]
    optimizer: str
    model_config: dict[str, Any]
    world_size: int
    loss_scaler: dict[str, Any] | None = None  # fp16 runs: the dynamic scale and its counters
    weights_only: bool = False  # model weights without optimizer or data state (an imported model)


def checkpoints_dir(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / ".metadata").is_file()


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete `step_<N>` directory of a run, or None."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return max(found)[1] if found else None


def check_checkpoint(path: Path) -> None:
    """Fail with one clear line unless `path` is a complete, untruncated polytrain checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    state_file = path / STATE_FILE
    if not path.is_dir() or not state_file.is_file():
        raise CheckpointError(
            f"{path} is not a polytrain checkpoint (no {STATE_FILE}); point checkpoint.resume "
            f"at a runs/<name>/checkpoints/step_<N> directory"
        )
    try:
        fmt = json.loads(state_file.read_text()).get("format")
    except (json.JSONDecodeError, AttributeError):
        fmt = None
    if fmt != FORMAT:
        raise CheckpointError(f"{state_file} is not a {FORMAT} file (format {fmt!r})")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no .metadata); resume from an earlier one")
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        actual = file.stat().st_size if file.is_file() else -1
        if actual < size:
            what = "missing" if actual < 0 else f"truncated ({actual} of {size} bytes)"
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is {what}; resume from an earlier one")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _json_bytes(state: TrainerState) -> bytes:
    return json.dumps({"format": FORMAT, **asdict(state)}, indent=1).encode()


class Checkpointer:
    """Saves and restores model, optimizer and trainer state for one run directory."""

    def __init__(self, run_dir: Path, keep: int, rng_state: Any, set_rng_state: Any):
        self.root = checkpoints_dir(run_dir)
        self.keep = keep
        self._rng_state, self._set_rng_state = rng_state, set_rng_state

    def clear_partial(self) -> None:
        """Remove directories left by saves that never finished (rank 0, at start-up)."""
        if _rank() == 0 and self.root.is_dir():
            for p in self.root.glob(TMP_PREFIX + "step_*"):
                shutil.rmtree(p, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    def save(self, tensors: Stateful, state: TrainerState) -> Path:
        """Write `tensors.state_dict()` ({"model", "optim"}: the data-parallel strategy's) and `state`."""
        rank = _rank()

        def rank_files() -> dict[str, bytes]:
            if os.environ.get(_KILL_DURING_SAVE_ENV) == str(state.step):
                os.kill(os.getpid(), signal.SIGKILL)  # the test's power cut: shards written, the rest not
            return {f"rng/rank_{rank}.pt": torch_bytes(self._rng_state())}

        final = write_checkpoint_dir(self.root / f"step_{state.step}", tensors.state_dict(),
                                     rank_files=rank_files, main_files=lambda: {STATE_FILE: _json_bytes(state)})
        if rank == 0:
            self._prune()
        if dist.is_initialized():
            dist.barrier()
        return final

    def _prune(self) -> None:
        if self.keep == 0:
            return
        done = sorted((int(m.group(1)), p) for p in self.root.iterdir()
                      if (m := _STEP_DIR.match(p.name)) and is_complete(p))
        for _, old in done[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, tensors: Stateful, expect: TrainerState) -> TrainerState:
        """Restore model and optimizer tensors through `tensors` (the data-parallel strategy), at any layout.

        `expect` describes this run; a checkpoint of another model or optimizer is refused.
        """
        check_checkpoint(path)
        record = json.loads((path / STATE_FILE).read_text())
        record.pop("format")
        state = TrainerState(**record)
        if state.model_config != expect.model_config:
            diff = {k: (state.model_config.get(k), v) for k, v in expect.model_config.items()
                    if state.model_config.get(k) != v}
            shown = ", ".join(f"model.{k} {a} in the checkpoint vs {b} now" for k, (a, b) in diff.items())
            raise CheckpointError(f"checkpoint {path} was written for another model: {shown}")
        if state.optimizer != expect.optimizer and not state.weights_only:
            raise CheckpointError(
                f"checkpoint {path} holds {state.optimizer} state but train.optimizer = "
                f"{expect.optimizer}; resume with the same optimizer or set checkpoint.resume = none")
        # DCP fills this rank's tensors of the strategy's state dict in place; a weights-only
        # checkpoint fills the model's and leaves the fresh optimizer state as it is.
        tensors_sd = tensors.state_dict()
        load_in_place({"model": tensors_sd["model"]} if state.weights_only else tensors_sd, path)
        tensors.load_state_dict(tensors_sd)
        if state.weights_only:
            return state
        rng_file = path / "rng" / f"rank_{_rank()}.pt"
        if state.world_size == (dist.get_world_size() if dist.is_initialized() else 1) and rng_file.is_file():
            self._set_rng_state(torch.load(rng_file, weights_only=False))
        return state


def save_weights(path: Path, model_state: dict[str, torch.Tensor], model_config: dict[str, Any]) -> Path:
    """Write a weights-only checkpoint (step 0, no optimizer or data state) at `path`, atomically.

    What `polytrain convert` makes of an imported model: `polytrain generate` loads it like
    any checkpoint, and training started from it (checkpoint.resume) takes the weights and
    begins at step 0 with a fresh optimizer, at any parallel layout.
    """
    state = TrainerState(step=0, sampler={}, optimizer="none", model_config=model_config, world_size=1,
                         weights_only=True)
    return write_checkpoint_dir(Path(path), {"model": model_state}, main_files=lambda: {STATE_FILE: _json_bytes(state)})


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model weights of a checkpoint into a plain single-device model."""
    check_checkpoint(path)
    state = {"model": model.state_dict()}
    load_in_place(state, path)
    model.load_state_dict(state["model"])


def load_in_place(state: dict[str, Any], path: Path) -> None:
    """dcp.load in place, with any failure turned into one CheckpointError line."""
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as e:
        # DCP collects per-rank exceptions in CheckpointException.failures; show the first.
        cause = next(iter(getattr(e, "failures", {}).values()), e)
        text = str(cause).strip().splitlines()
        raise CheckpointError(f"cannot load checkpoint {path}: {text[0] if text else type(cause).__name__}") from e
