"""Tensors to and from files in large blocks on background threads (ZeRO-3's nvme offload).

    io = BlockIO(directory)
    f = io.file("unit3_param", nbytes)                 # a sparse file of zeros
    done = io.read(f, [(tensor, offset), ...])         # a Future; tensors filled once it is done
    done = io.write(f, [(tensor, offset), ...])        # the tensors must live until it is done
    done.result()

Each tensor is one contiguous region of its file, moved by one `os.preadv` / `os.pwritev`
call (split only above MAX_CALL_BYTES): the kernel sees a few large sequential requests
per unit, not the page faults of a memory-mapped file touched element by element. The
calls run on a small thread pool (they release the GIL), so a unit's state loads while
another unit computes. Tensors are host tensors, kept alive by the caller until done.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

MAX_CALL_BYTES = 1 << 30  # Linux moves at most ~2 GiB per read/write call
THREADS = 2


def _buffer(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, writable in place.

    Through ctypes, not numpy: `Tensor.numpy()` marks the storage as not resizable, and
    ZeRO-3's nvme offload frees and regrows these storages.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("block I/O moves contiguous host tensors")
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class BlockIO:
    """Files under `directory` and the threads that read and write them."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="polytrain-nvme")
        self._fds: dict[Path, int] = {}
        self.bytes_read = self.bytes_written = 0

    def file(self, name: str, nbytes: int) -> Path:
        """A file of `nbytes` zero bytes (sparse until written), open for reading and writing."""
        path = self.directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, nbytes)
        self._fds[path] = fd
        return path

    def read(self, path: Path, regions: list[tuple[torch.Tensor, int]]) -> Future:
        """Fill each tensor from its byte offset in `path`, in the background."""
        self.bytes_read += sum(t.numel() * t.element_size() for t, _ in regions)
        return self._pool.submit(self._move, self._fds[path], regions, os.preadv)

    def write(self, path: Path, regions: list[tuple[torch.Tensor, int]]) -> Future:
        """Write each tensor at its byte offset in `path`, in the background."""
        self.bytes_written += sum(t.numel() * t.element_size() for t, _ in regions)
        return self._pool.submit(self._move, self._fds[path], regions, os.pwritev)

    @staticmethod
    def _move(fd: int, regions: list[tuple[torch.Tensor, int]], call) -> None:
        for tensor, offset in regions:
            data = _buffer(tensor)
            done = 0
            while done < len(data):
                n = call(fd, [data[done:done + MAX_CALL_BYTES]], offset + done)
                if n <= 0:
                    raise OSError(f"block I/O moved {n} bytes at offset {offset + done}")
                done += n

    def close(self) -> None:
        """Finish queued work and close the files (they stay on disk; the caller removes the directory)."""
        self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
