"""Where ZeRO-1/2 keep this rank's fp32 shards: `parallel.offload = "none" | "cpu" | "nvme"`.

ZeroDataParallel asks a `ShardStore` for its flat per-bucket buffers (S,) and never
cares where they are:

    offload   master shard (fp32)     gradient shard   optimizer state          optimizer steps on
    none      accelerator             accelerator      accelerator (by torch)   accelerator
    cpu       host (pinned)           host             host (by torch)          host
    nvme      memory-mapped file      host             memory-mapped files      host

Compute parameters stay on the accelerator in every case. With "nvme" each rank
writes one file per bucket and kind into a fresh directory of its own under
`parallel.nvme_path`, e.g. `rank1-x3f9/rank1_bucket4_exp_avg.f32`, S float32 values
each; the OS pages them in and out, so the state may exceed host memory. The files
are created zeroed at start-up (a resume fills them from the checkpoint) and deleted
by `close()`, when the store is garbage collected, or at interpreter exit.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from polytrain.errors import ConfigError
from polytrain.optim.lamb import Lamb
from polytrain.optim.lars import Lars

OFFLOADS = ("none", "cpu", "nvme")


class ShardStore:
    """Allocates the zero-filled fp32 buffers of one rank's ZeRO buckets where `offload` says."""

    def __init__(self, offload: str = "none", nvme_dir: str | Path | None = None, rank: int = 0,
                 pin: bool = False):
        """`pin`: page-lock host buffers (cpu offload; when the accelerator can use pinned memory)."""
        if offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {OFFLOADS}, not {offload!r}")
        self.offload, self.rank = offload, rank
        self.host = torch.device("cpu")
        # Page-locked masters let the copy to the device after each step run asynchronously.
        self.pin = offload == "cpu" and pin
        self.dir: Path | None = None
        if offload == "nvme":
            if nvme_dir is not None:
                Path(nvme_dir).mkdir(parents=True, exist_ok=True)
            # A directory per store: ranks (and successive runs of one process) never collide.
            self.dir = Path(tempfile.mkdtemp(prefix=f"rank{rank}-", dir=nvme_dir))
            self._remove = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)

    @property
    def offloaded(self) -> bool:
        """Whether masters, gradient shards and optimizer state live on the host, not the accelerator."""
        return self.offload != "none"

    @property
    def maps_state(self) -> bool:
        """Whether the optimizer state must be set up from `state()` buffers before the first step."""
        return self.offload == "nvme"

    def master(self, bucket: int, size: int, device: torch.device) -> torch.Tensor:
        """Bucket `bucket`'s fp32 master shard (S,)."""
        if self.offload == "nvme":
            return self._mapped(bucket, "master", size)
        if self.offload == "cpu":
            return torch.zeros(size, device=self.host, pin_memory=self.pin)
        return torch.zeros(size, device=device)

    def grad(self, bucket: int, size: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed reduced-gradient shard (S,) for bucket `bucket` (asked for once per step that has gradients)."""
        return torch.zeros(size, dtype=dtype, device=self.host if self.offloaded else device)

    def state(self, bucket: int, name: str, size: int) -> torch.Tensor:
        """Bucket `bucket`'s optimizer-state tensor `name` (e.g. "exp_avg"), flat (S,); nvme only."""
        if not self.maps_state:
            raise RuntimeError(f"offload = {self.offload!r} leaves the optimizer state to torch")
        return self._mapped(bucket, name, size)

    def files(self) -> list[Path]:
        """The memory-mapped files of this store, sorted by name ([] unless nvme)."""
        return sorted(self.dir.iterdir()) if self.dir else []

    def close(self) -> None:
        """Delete the files (mapped tensors stay valid until dropped; the space is freed then)."""
        if self.dir is not None:
            self._remove()

    def _mapped(self, bucket: int, name: str, size: int) -> torch.Tensor:
        # shared=True maps the file MAP_SHARED: writes go to the file, which torch
        # creates and sizes to `size` zeros (sparse until written).
        path = self.dir / f"rank{self.rank}_bucket{bucket}_{name}.f32"
        return torch.from_file(str(path), shared=True, size=size, dtype=torch.float32)


def state_names(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The per-parameter state tensors (each shaped like its parameter) that `optimizer` keeps."""
    if isinstance(optimizer, torch.optim.Adam) and not any(g["amsgrad"] for g in optimizer.param_groups):
        return ("exp_avg", "exp_avg_sq")  # AdamW is an Adam
    if isinstance(optimizer, Lamb):
        return ("exp_avg", "exp_avg_sq")
    if isinstance(optimizer, Lars) or (isinstance(optimizer, torch.optim.SGD)
                                       and all(g["momentum"] for g in optimizer.param_groups)):
        return ("momentum_buffer",)
    raise ValueError(f"nvme offload does not know the state of {type(optimizer).__name__}")


def fresh_state(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> dict:
    """One parameter's state as torch would create it at the first step, around zero-filled `tensors`.

    Torch's optimizers create state only where it is missing and then update it in
    place, so every step reads and writes the given tensors. (SGD's first step copies
    the gradient into a missing momentum buffer; into a zero buffer, 0.9 * 0 + g is g
    exactly.)
    """
    if isinstance(optimizer, (torch.optim.Adam, Lamb)):
        return {"step": torch.tensor(0.0), **tensors}  # a host scalar, as torch's own
    return dict(tensors)


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be made in `directory`, by trying: permission bits do not bind root, and
    a read-only or special file system (procfs, a read-only mount) refuses root too."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def check_nvme_path(nvme_path: str) -> None:
    """ConfigError unless `nvme_path` is, or can be created as, a writable directory."""
    path = Path(nvme_path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"parallel.nvme_path = '{nvme_path}': {existing} is not a directory; "
                          "point it at a directory on a fast local disk")
    if not _can_create_in(existing):
        raise ConfigError(f"parallel.nvme_path = '{nvme_path}': {existing} is not writable; "
                          "point it at a writable directory on a fast local disk")
