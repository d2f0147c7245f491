"""Hugging Face model directories: config.json and weights, read lazily and written back.

Weights may be one `model.safetensors`, sharded safetensors with a
`model.safetensors.index.json`, or the older `pytorch_model.bin` (also sharded with
its index). Tensors are read one at a time by name (safetensors memory-maps its
files), so a converter holds only the tensors it is working on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from polytrain.errors import CheckpointError, ConfigError

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def read_config(hf_dir: Path) -> dict:
    """config.json of a Hugging Face model directory; ConfigError if missing or not JSON."""
    path = Path(hf_dir) / CONFIG
    if not Path(hf_dir).is_dir():
        raise ConfigError(f"{hf_dir} is not a directory")
    if not path.is_file():
        raise ConfigError(f"{hf_dir} is not a Hugging Face model directory (no {CONFIG})")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return config


class HFTensors(Mapping):
    """name -> tensor of a Hugging Face checkpoint, each read from its file when asked for."""

    def __init__(self, hf_dir: Path):
        self.dir = Path(hf_dir)
        self._file_of: dict[str, Path] = {}  # tensor name -> file holding it
        self._bin: dict[Path, dict[str, torch.Tensor]] = {}  # loaded .bin shards (memory-mapped)
        if (self.dir / SAFETENSORS).is_file():
            self._add_safetensors([self.dir / SAFETENSORS])
        elif (self.dir / SAFETENSORS_INDEX).is_file():
            self._add_safetensors(self._shards(self.dir / SAFETENSORS_INDEX))
        elif (self.dir / BIN).is_file():
            self._add_bin([self.dir / BIN])
        elif (self.dir / BIN_INDEX).is_file():
            self._add_bin(self._shards(self.dir / BIN_INDEX))
        else:
            raise CheckpointError(f"{self.dir} has no weights ({SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} "
                                  f"or {BIN_INDEX})")

    def _shards(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index} is not a weight index (no weight_map)") from None
        files = sorted({self.dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} names shards that are missing: {', '.join(missing)}")
        return files

    def _add_safetensors(self, files: list[Path]) -> None:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    self._file_of.update(dict.fromkeys(f.keys(), file))
            except Exception as e:  # safetensors raises its own error types for damaged headers
                raise CheckpointError(f"cannot read {file}: {e}") from None

    def _add_bin(self, files: list[Path]) -> None:
        for file in files:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise CheckpointError(f"cannot read {file}: {e}") from None
            self._bin[file] = state
            self._file_of.update(dict.fromkeys(state, file))

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._file_of[name]
        if file in self._bin:
            return self._bin[file][name]
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


class Reader:
    """Tensors by their name inside the model, whatever prefix the checkpoint saved them under.

    The same weights appear as `h.0.attn...` (saved from GPT2Model) or
    `transformer.h.0.attn...` (from GPT2LMHeadModel); `prefixes` lists the forms to
    try. Every tensor read is recorded, so the converter can refuse a checkpoint with
    tensors it would silently drop.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], prefixes: tuple[str, ...] = ("",),
                 source: str = "the checkpoint"):
        self.tensors, self.prefixes, self.source = tensors, prefixes, source
        self.used: set[str] = set()
        self.recent: list[str] = []  # read since the last Converted assignment

    def _key(self, name: str) -> str | None:
        return next((p + name for p in self.prefixes if p + name in self.tensors), None)

    def has(self, name: str) -> bool:
        return self._key(name) is not None

    def __call__(self, name: str) -> torch.Tensor:
        key = self._key(name)
        if key is None:
            raise CheckpointError(f"{self.source} has no tensor {self.prefixes[0] + name!r}")
        self.used.add(key)
        self.recent.append(key)
        return self.tensors[key]

    def unused(self, ignore: tuple[str, ...] = ()) -> list[str]:
        """Tensors never read, except names containing one of `ignore` (buffers, unused heads)."""
        return sorted(k for k in self.tensors if k not in self.used and not any(s in k for s in ignore))


class Converted(dict):
    """polytrain name -> tensor, remembering which checkpoint tensors each came from.

    A converter reads its sources through `reader`, then assigns the results; the
    keys read since the previous assignment (or, for pieces split from one source,
    the previous assignment's) become the origin named in shape errors.
    """

    def __init__(self, reader: Reader):
        super().__init__()
        self.reader = reader
        self.origin: dict[str, list[str]] = {}
        self._last: list[str] = []

    def set_output(self, hf_name: str, tied: bool) -> None:
        """output.weight from `hf_name`, unless tied to the embedding: then a stored copy is read
        (so it does not count as left over) and dropped, as transformers does."""
        if not tied:
            self["output.weight"] = self.reader(hf_name)
        elif self.reader.has(hf_name):
            self.reader(hf_name)
            self.reader.recent = []

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        if self.reader.recent:
            self._last, self.reader.recent = self.reader.recent, []
        self.origin[name] = self._last
        super().__setitem__(name, tensor)


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file with the metadata transformers expects ({"format": "pt"})."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
