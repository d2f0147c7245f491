"""Engine checkpoints: DeepSpeed's directory conventions over polytrain's Distributed Checkpoint layout.

    <save_dir>/
        latest                          # the newest tag, as DeepSpeed writes it
        <tag>/                          # default tag: global_step<N>
            .metadata, __<rank>_0.distcp  # {"model", "optim"}: the data-parallel strategy's state (DCP)
            client_state.pt             # the client_state dict handed to save_checkpoint
            engine.json                 # step counters, lr scheduler, loss scale; written last

A tag is written by `write_checkpoint_dir` (polytrain/checkpoint/directory.py): into
`.tmp-<tag>/`, synced and renamed once every rank has finished, so a crash or a failure while
saving leaves the previous checkpoint (and `latest`) intact. As with the trainer's
checkpoints, DCP stores tensors by name with their global shapes, so a checkpoint saved at
one data-parallel / ZeRO layout loads at another.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from polytrain.checkpoint import load_in_place, torch_bytes, verify_checkpoint, write_checkpoint_dir
from polytrain.distributed.data_parallel import DataParallel
from polytrain.distributed.world import barrier
from polytrain.errors import CheckpointError
from polytrain.io.atomic import write_text_atomic

FORMAT = "polytrain-engine-checkpoint-1"
STATE_FILE = "engine.json"
CLIENT_FILE = "client_state.pt"
LATEST = "latest"


def save(save_dir: str | os.PathLike, tag: str, dp: DataParallel, state: dict[str, Any],
         client_state: dict[str, Any], save_latest: bool) -> Path:
    """Write one tag collectively (every rank calls this); returns its directory."""
    root = Path(save_dir)
    record = json.dumps({"format": FORMAT, "tag": tag, **state}, indent=1).encode()
    final = write_checkpoint_dir(root / tag, dp.state_dict(),
                                 main_files=lambda: {CLIENT_FILE: torch_bytes(client_state), STATE_FILE: record})
    if save_latest and (not dist.is_initialized() or dist.get_rank() == 0):
        write_text_atomic(root / LATEST, tag)
    barrier()
    return final


def read_latest(load_dir: str | os.PathLike) -> str | None:
    """The tag `latest` names, or None when there is no `latest` file."""
    path = Path(load_dir) / LATEST
    return path.read_text().strip() if path.is_file() else None


def load(path: Path, dp: DataParallel, optimizer_states: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore the strategy's tensors from `path` (only the model's without `optimizer_states`).

    Returns (the engine state saved with it, the client_state).
    """
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{path} is not a polytrain engine checkpoint (no {STATE_FILE}); pass "
                              "the directory given to save_checkpoint and one of its tags")
    state = json.loads(state_file.read_text())
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{state_file} is not a {FORMAT} file (format {state.get('format')!r})")
    verify_checkpoint(path)  # manifest.json's digests, the ranks sharing the reading
    tensors = dp.state_dict()
    # DCP fills the tensors in place; the optimizer entry keeps its current values when skipped.
    load_in_place(tensors if optimizer_states else {"model": tensors["model"]}, path)
    dp.load_state_dict(tensors)
    client_state = torch.load(path / CLIENT_FILE, weights_only=False)
    return state, client_state
