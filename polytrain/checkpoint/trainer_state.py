"""Resumable, layout-independent checkpoints with PyTorch Distributed Checkpoint (DCP).

    <run dir>/checkpoints/step_<N>/
        .metadata, __<rank>_0.distcp   # model + optimizer, keyed by parameter name (DCP)
        rng/rank_<r>.pt                # each rank's RNG states
        manifest.json                  # every file's size and BLAKE2b digest, checked at load (manifest.py)
        trainer.json                   # step, optimizer_steps (which fix the lr schedule), sampler position,
                                       # model config and, with LoRA, the adapters' record and their base

A checkpoint is written by `write_checkpoint_dir` (directory.py): into `.tmp-step_<N>/`,
synced to disk and renamed once every rank has finished, with trainer.json written last;
a crash or a failure while saving leaves only a `.tmp-` directory, which is ignored and
cleared, so the previous checkpoint stays the newest complete one. DCP stores every
tensor by name with its global shape, so a checkpoint written at one data-parallel /
ZeRO layout loads at any other.

LoRA (polytrain/lora): a run that trains only its adapters (lora.only_optimize) saves only the
adapters and their optimizer state; trainer.json's `base` says where the frozen weights come
from: the checkpoint they were loaded from, or `init:<seed>` for the seeded initialisation.
Loading follows it, a checkpoint without adapters loads into an adapted model as its base
(the adapters keep their initial values), and pruning keeps every checkpoint a kept one
names as its base.
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from polytrain.checkpoint import manifest
from polytrain.checkpoint.async_save import BackgroundWriter, stage_to_host
from polytrain.checkpoint.directory import TMP_PREFIX, agree, dcp_cause, torch_bytes, write_checkpoint_dir
from polytrain.checkpoint.run_dir import RunDir
from polytrain.errors import CheckpointError
from polytrain.lora import is_adapter_key, lora_record
from polytrain.models.common.init import init_plain

FORMAT = "polytrain-checkpoint-1"
STATE_FILE = "trainer.json"
# DCP warns on every single-process save/load that it assumes a single process: it does, by design.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Test hook: the rank that reaches this step's save kills itself mid-write (SIGKILL),
# as a power cut or OOM killer would.
_KILL_DURING_SAVE_ENV = "POLYTRAIN_TEST_KILL_DURING_SAVE"
# Test hook, "<step>:<rank>": that rank's RNG-state file cannot be written at that step's save
# (its path is taken by a directory), while the other ranks write theirs.
_FAIL_RNG_SAVE_ENV = "POLYTRAIN_TEST_FAIL_RNG_SAVE"


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
    optimizer_steps: int | None = None  # updates applied (step minus skipped fp16 steps); None: older checkpoints
    lora: dict[str, Any] | None = None  # the LoRA adapters' config (polytrain.lora.lora_record), None without
    base: str | None = None  # adapters only: the checkpoint holding the frozen base, or "init:<seed>"

    @property
    def adapters_only(self) -> bool:
        return self.base is not None

    @property
    def adapter_shape(self) -> tuple | None:
        """What decides the adapters' tensors and their meaning: (rank, alpha, targets), None without LoRA."""
        return (self.lora["rank"], self.lora["alpha"], self.lora["targets"]) if self.lora else None

    def applied_steps(self) -> int:
        """Optimizer updates applied up to `step`: the position of the learning-rate schedule."""
        if self.optimizer_steps is not None:
            return self.optimizer_steps
        return self.step - (self.loss_scaler or {}).get("skipped_steps", 0)


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
    metadata = read_metadata(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        actual = file.stat().st_size if file.is_file() else -1
        if actual < size:
            what = "missing" if actual < 0 else f"truncated ({actual} of {size} bytes)"
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is {what}; resume from an earlier one")


def read_metadata(path: Path) -> Any:
    """DCP's .metadata of `path`; a garbled one is one CheckpointError, not an unpickling traceback."""
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} is damaged: .metadata cannot be read ({_first_line(e)}); "
                              "resume from an earlier one") from None


def verify_checkpoint(path: Path) -> None:
    """Check `path`'s files against its manifest, the ranks sharing the reading (collective when a
    process group exists, as loading is); a damaged file is one CheckpointError on every rank."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    agree(lambda: manifest.verify(path, _rank(), world))


def _first_line(e: BaseException) -> str:
    cause = dcp_cause(e)
    text = str(cause).strip().splitlines()
    return text[0] if text else type(cause).__name__


def read_state(path: Path) -> TrainerState:
    """A checked checkpoint's trainer.json."""
    check_checkpoint(path)
    record = json.loads((Path(path) / STATE_FILE).read_text())
    record.pop("format")
    return TrainerState(**record)


def model_keys(path: Path) -> set[str]:
    """Names of the model tensors a checkpoint holds."""
    metadata = read_metadata(path)
    return {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}


def fill_model_state(path: Path, state: TrainerState, model_sd: dict[str, Any], seed: int | None = None) -> None:
    """Load checkpoint `path`'s model tensors into `model_sd` in place (collectively, at any layout).

    Adapters only: the base weights come from `state.base` first, a checkpoint, or (`init:<seed>`)
    the seeded initialisation, which must be the run's own (`seed`: the values materialize gave
    `model_sd`; None: they come from `init_seeded`, the caller's). A checkpoint without adapters
    loaded into an adapted model fills the base and leaves the adapters as they are.
    """
    verify_checkpoint(path)  # before any tensor is taken from it; a base is checked by its own call
    held = model_keys(path)
    missing = [k for k in model_sd if k not in held]
    if state.adapters_only:
        base = [k for k in missing if not is_adapter_key(k)]
        if state.base.startswith("init:"):
            if seed is not None and state.base != f"init:{seed}":
                raise CheckpointError(f"the adapters in {path} were trained on the base initialised from "
                                      f"run.seed = {state.base.removeprefix('init:')}; set run.seed to it")
        elif base:
            base_path = Path(state.base)
            if not (base_path / STATE_FILE).is_file():
                raise CheckpointError(f"the adapters in {path} need their base weights from {base_path}, "
                                      "which is no longer a checkpoint; restore it or start again")
            fill_model_state(base_path, read_state(base_path), {k: model_sd[k] for k in base}, seed)
        missing = [k for k in missing if is_adapter_key(k)]
    elif state.lora is None:
        missing = [k for k in missing if not is_adapter_key(k)]  # a base for adapters: they keep their values
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {path} has no tensor {missing[0]}{more} of this model")
    load_in_place({"model": {k: v for k, v in model_sd.items() if k in held}}, path)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _json_bytes(state: TrainerState) -> bytes:
    return json.dumps({"format": FORMAT, **asdict(state)}, indent=1).encode()


class Checkpointer:
    """Saves and restores model, optimizer and trainer state for one run directory.

    `async_save`: `save` stages the state in host memory and writes it in a background thread
    (async_save.py), returning while the write runs; `wait` ends it (the next save does too).
    """

    def __init__(self, run_dir: Path, keep: int, rng_state: Any, set_rng_state: Any, async_save: bool = False):
        self.root = checkpoints_dir(run_dir)
        self.keep = keep
        self._rng_state, self._set_rng_state = rng_state, set_rng_state
        self._writer = BackgroundWriter() if async_save else None

    def clear_partial(self) -> None:
        """Remove directories left by saves that never finished (rank 0, at start-up)."""
        if _rank() == 0 and self.root.is_dir():
            for p in self.root.glob(TMP_PREFIX + "step_*"):
                shutil.rmtree(p, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    def save(self, tensors: Stateful, state: TrainerState) -> Path:
        """Write `tensors.state_dict()` ({"model", "optim"}: the data-parallel strategy's) and `state`
        (of the model, only the adapters when `state.base` is set). Collective. Asynchronous saves
        return once the state is staged, with the checkpoint still being written (`wait`)."""
        rank = _rank()
        rng = torch_bytes(self._rng_state())  # now: the steps the thread overlaps draw from the RNGs

        def rank_files() -> dict[str, bytes]:
            if os.environ.get(_KILL_DURING_SAVE_ENV) == str(state.step):
                os.kill(os.getpid(), signal.SIGKILL)  # the test's power cut: shards written, the rest not
            if os.environ.get(_FAIL_RNG_SAVE_ENV) == f"{state.step}:{rank}":
                (self.root / f"{TMP_PREFIX}step_{state.step}" / "rng" / f"rank_{rank}.pt").mkdir(parents=True)
            return {f"rng/rank_{rank}.pt": rng}

        final, state_bytes = self.root / f"step_{state.step}", _json_bytes(state)

        def write(tensors_sd: dict[str, Any], group: Any) -> None:
            write_checkpoint_dir(final, tensors_sd, rank_files=rank_files,
                                 main_files=lambda: {STATE_FILE: state_bytes}, group=group)
            # Agreed, not a barrier: a checkpoint pruning cannot read fails rank 0 alone.
            agree(self._prune if rank == 0 else None, group)

        if self._writer is not None:
            self._writer.wait()  # one save in flight; its staged copy is freed before the next is made
        tensors_sd = tensors.state_dict()
        if state.adapters_only:  # the frozen base is in state.base
            tensors_sd = {**tensors_sd, "model": {k: v for k, v in tensors_sd["model"].items() if is_adapter_key(k)}}
        if self._writer is None:
            write(tensors_sd, None)
        else:
            staged = stage_to_host(tensors_sd)
            self._writer.submit(lambda group: write(staged, group), final.name)
        return final

    def wait(self) -> None:
        """Block until an asynchronous save in flight is complete on disk; raise its error (a
        CheckpointError) if it failed. Nothing to do for synchronous saves."""
        if self._writer is not None:
            self._writer.wait()

    def _prune(self) -> None:
        if self.keep == 0:
            return
        done = sorted((int(m.group(1)), p) for p in self.root.iterdir()
                      if (m := _STEP_DIR.match(p.name)) and is_complete(p))
        kept = [p for _, p in done[-self.keep:]]
        bases = {Path(b).resolve() for p in kept if (b := read_state(p).base) and not b.startswith("init:")}
        for _, old in done[: -self.keep]:
            if old.resolve() not in bases:  # adapters-only checkpoints need their base
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, tensors: Stateful, expect: TrainerState, seed: int | None = None) -> TrainerState:
        """Restore model and optimizer tensors through `tensors` (the data-parallel strategy), at any layout.

        `expect` describes this run; a checkpoint of another model or optimizer is refused, as
        adapters of another shape. A checkpoint without adapters loaded by a LoRA run is its
        base: weights only, returned with `weights_only` set. `seed`: the run's, for a base
        the adapters' checkpoint says was initialised from a seed.
        """
        state = read_state(path)
        if state.model_config != expect.model_config:
            diff = {k: (state.model_config.get(k), v) for k, v in expect.model_config.items()
                    if state.model_config.get(k) != v}
            shown = ", ".join(f"model.{k} {a} in the checkpoint vs {b} now" for k, (a, b) in diff.items())
            raise CheckpointError(f"checkpoint {path} was written for another model: {shown}")
        if state.lora is not None and state.adapter_shape != expect.adapter_shape:
            rank, alpha, targets = state.adapter_shape
            raise CheckpointError(f"checkpoint {path} holds LoRA adapters of rank {rank}, alpha {alpha}, targets "
                                  f"{targets!r}; set lora.rank, lora.alpha and lora.targets to them "
                                  "(or merge them: polytrain convert --to hf)")
        if state.lora is None and expect.lora is not None:
            if not state.weights_only and Path(path).resolve().parent == self.root.resolve():
                # Its step count would win over the adapters' new one at the next resume.
                raise CheckpointError(f"{path} is a trained checkpoint of this run without adapters; start the "
                                      "LoRA run in a directory of its own (--run.out_dir) with "
                                      f"--checkpoint.resume {path}")
            state.weights_only = True  # the base of this run's adapters
        if state.optimizer != expect.optimizer and not state.weights_only:
            raise CheckpointError(
                f"checkpoint {path} holds {state.optimizer} state but train.optimizer = "
                f"{expect.optimizer}; resume with the same optimizer or set checkpoint.resume = none")
        # DCP fills this rank's tensors of the strategy's state dict in place; a weights-only
        # checkpoint fills the model's and leaves the fresh optimizer state as it is. Entries
        # besides "model" (the optimizer's, and e.g. RLHF's critic and EMA actor) load as saved.
        tensors_sd = tensors.state_dict()
        fill_model_state(path, state, tensors_sd["model"], seed)
        if not state.weights_only:
            load_in_place({k: v for k, v in tensors_sd.items() if k != "model"}, path)
        tensors.load_state_dict(tensors_sd)
        if state.weights_only:
            return state
        rng_file = Path(path) / "rng" / f"rank_{_rank()}.pt"
        if state.world_size == (dist.get_world_size() if dist.is_initialized() else 1):
            agree(lambda: self._load_rng(Path(path), rng_file))
        return state

    def _load_rng(self, path: Path, rng_file: Path) -> None:
        if not rng_file.is_file():
            return
        try:
            rng = torch.load(rng_file, weights_only=False)
        except Exception as e:  # a garbled file: torch.load's own error, whatever it is
            raise CheckpointError(f"checkpoint {path} is damaged: {rng_file.relative_to(path).as_posix()} cannot "
                                  f"be read ({_first_line(e)}); resume from an earlier one") from None
        self._set_rng_state(rng)


def save_weights(path: Path, model_state: dict[str, torch.Tensor], model_config: dict[str, Any],
                 lora: Any = None, base: str | None = None) -> Path:
    """Write a weights-only checkpoint (step 0, no optimizer or data state) at `path`, atomically.

    What `polytrain convert` makes of an imported model: `polytrain generate` loads it like
    any checkpoint, and training started from it (checkpoint.resume) takes the weights and
    begins at step 0 with a fresh optimizer, at any parallel layout. An imported PEFT adapter:
    `model_state` holds the adapters of `lora` (a LoRAConfig), `base` the checkpoint of their base.
    """
    state = TrainerState(step=0, sampler={}, optimizer="none", model_config=model_config, world_size=1,
                         weights_only=True, lora=lora_record(lora) if lora is not None else None, base=base)
    return write_checkpoint_dir(Path(path), {"model": model_state}, main_files=lambda: {STATE_FILE: _json_bytes(state)})


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model weights of a checkpoint into a plain single-device model (with the
    checkpoint's LoRA adapters applied, when it has them; see polytrain.lora.apply_lora)."""
    state = read_state(path)
    if state.adapters_only and state.base.startswith("init:"):  # a seeded base: make it, then load the adapters
        init_plain(model, int(state.base.removeprefix("init:")))
    model_sd = model.state_dict()
    fill_model_state(path, state, model_sd)
    model.load_state_dict(model_sd)


def load_in_place(state: dict[str, Any], path: Path) -> None:
    """dcp.load in place, with any failure turned into one CheckpointError line."""
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"cannot load checkpoint {path} ({_first_line(e)}); it is damaged: "
                              "resume from an earlier one") from None
