"""Consolidate a checkpoint's model weights into one plain state dict file.

What DeepSpeed users do with zero_to_fp32: a checkpoint written at any layout (one
process, data parallel, ZeRO-3 sharded over any number of ranks) becomes one
`{fqn: tensor}` file that a plain model loads with `load_state_dict`, e.g.

    polytrain consolidate runs/default/checkpoints/step_1000 model.safetensors --dtype bf16

Tensors are read one at a time (DCP reads only the requested key, gathering a sharded
tensor's pieces from every rank's file), so the whole model is never in memory twice.
safetensors is the low-memory path: all shapes are in the checkpoint's metadata, so the
header is written first and each tensor is streamed after it: peak memory is about twice
the largest tensor (DCP's read buffer and the tensor), whatever the model's size.
`pt` (torch.save) needs the whole dict in memory once.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from polytrain.checkpoint import manifest
from polytrain.checkpoint.directory import dcp_cause
from polytrain.checkpoint.trainer_state import STATE_FILE, check_checkpoint, latest_checkpoint
from polytrain.errors import CheckpointError, ConfigError
from polytrain.io.atomic import atomic_path

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = ("safetensors", "pt")
_PT_SUFFIXES = (".pt", ".pth", ".bin")
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


class _Reader(dcp.FileSystemReader):
    """A FileSystemReader that unpickles .metadata once.

    dcp.load reads it again on every call, which would otherwise take a third of the time
    of loading a checkpoint tensor by tensor.
    """

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def consolidate(checkpoint_dir: str | Path, out: str | Path, dtype: torch.dtype | str = torch.float32,
                fmt: str | None = None) -> Path:
    """Write the model weights of `checkpoint_dir` to `out` as one plain state dict; return the file.

    `dtype` (torch.float32/bfloat16/float16 or "fp32"/"bf16"/"fp16") applies to floating
    tensors. `fmt` is "safetensors" or "pt"; by default .pt/.pth/.bin files get "pt" and
    anything else "safetensors". An existing directory as `out` receives model.<format>.
    Tied weights appear under each of their names (safetensors cannot hold aliases).
    The file appears complete or not at all. A run directory stands for its newest checkpoint.
    """
    path = Path(checkpoint_dir)
    if (path / "config.toml").is_file() and not (path / STATE_FILE).is_file():
        newest = latest_checkpoint(path)
        if newest is None:
            raise CheckpointError(f"{path} has no complete checkpoint under checkpoints/")
        path = newest
    check_checkpoint(path)
    manifest.verify(path)  # one process reads every file here, so it checks all of them
    dtype = _resolve_dtype(dtype)
    out = Path(out)
    if fmt is None:
        fmt = "pt" if out.suffix in _PT_SUFFIXES else "safetensors"
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; choose {' or '.join(FORMATS)}")
    if out.is_dir():
        out = out / f"model.{fmt}"
    if not out.parent.is_dir():
        raise ConfigError(f"output directory {out.parent} does not exist; create it first")
    reader = _Reader(str(path))
    # fqn (without the "model." prefix) -> global shape and stored dtype, in checkpoint order
    entries = {key.removeprefix("model."): md for key, md in reader.read_metadata().state_dict_metadata.items()
               if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    if not entries:
        raise CheckpointError(f"checkpoint {path} holds no model tensors")
    state = json.loads((path / STATE_FILE).read_text())
    metadata = {"format": "pt", "source": "polytrain", "step": str(state["step"]),
                "model_config": json.dumps(state["model_config"], sort_keys=True)}
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        if fmt == "safetensors":
            _write_safetensors(f, reader, entries, dtype, metadata)
        else:
            torch.save(dict(_load_each(reader, entries, dtype)), f)
    return out


def read_model_tensors(checkpoint_dir: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{fqn: full tensor} of a checkpoint's model weights, in memory; dtype None keeps each stored dtype."""
    path = Path(checkpoint_dir)
    check_checkpoint(path)
    manifest.verify(path)
    reader = _Reader(str(path))
    entries = {key.removeprefix("model."): md for key, md in reader.read_metadata().state_dict_metadata.items()
               if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    return dict(_load_each(reader, entries, dtype))


def _load_each(reader: _Reader, entries: dict[str, TensorStorageMetadata],
               dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(fqn, full tensor) for each entry, loaded one at a time, floating ones cast to `dtype`."""
    for name, md in entries.items():
        tensor = torch.empty(md.size, dtype=md.properties.dtype)
        try:
            dcp.load({"model": {name: tensor}}, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            # DCP collects per-rank exceptions in CheckpointException.failures; show the first.
            cause = dcp_cause(e)
            text = str(cause).strip().splitlines()
            raise CheckpointError(f"cannot read {name} from checkpoint {reader.path}: "
                                  f"{text[0] if text else type(cause).__name__}") from e
        yield name, tensor.to(_out_dtype(tensor.dtype, dtype))


def _write_safetensors(f: BinaryIO, reader: _Reader, entries: dict[str, TensorStorageMetadata],
                       dtype: torch.dtype, metadata: dict[str, str]) -> None:
    """The header, computed from the checkpoint's metadata, then each tensor's bytes as it is loaded."""
    header: dict[str, dict] = {"__metadata__": metadata}
    offset = 0
    for name, md in entries.items():
        out_dtype = _out_dtype(md.properties.dtype, dtype)
        nbytes = md.size.numel() * out_dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[out_dtype], "shape": list(md.size),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data then starts 8-byte aligned, as safetensors' own writer does
    f.write(struct.pack("<Q", len(raw)))  # safetensors: u64 little-endian header length
    f.write(raw)
    for _, tensor in _load_each(reader, entries, dtype):
        f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _out_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    # Only weights change precision; integer or boolean tensors keep their values exactly.
    return dtype if stored.is_floating_point and dtype is not None else stored


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ConfigError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPES)}")
