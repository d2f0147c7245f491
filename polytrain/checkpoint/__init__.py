"""Checkpoints and run directories, below everything that reads or writes them (train, inference,
convert, the engine).

directory.py: the one routine that writes a checkpoint directory (temporary name -> DCP save
-> metadata -> fsync -> rename), collectively; trainer_state.py: the trainer's checkpoints
(`checkpoints/step_<N>/`: tensors, RNG states, trainer.json) and their loading at any layout;
consolidate.py: any checkpoint -> one safetensors / torch file; run_dir.py: a run directory's
file names; manifest.py: every file's digest, written at save and checked at load.
"""

from polytrain.checkpoint.directory import torch_bytes, write_checkpoint_dir
from polytrain.checkpoint.run_dir import RunDir
from polytrain.checkpoint.trainer_state import (
    STATE_FILE,
    Checkpointer,
    TrainerState,
    check_checkpoint,
    latest_checkpoint,
    load_in_place,
    load_model_weights,
    save_weights,
    verify_checkpoint,
)

__all__ = [
    "STATE_FILE", "Checkpointer", "RunDir", "TrainerState", "check_checkpoint", "latest_checkpoint",
    "load_in_place", "load_model_weights", "save_weights", "torch_bytes", "verify_checkpoint",
    "write_checkpoint_dir",
]
