"""Model registry: architecture name -> size presets and a builder.

Models are plain single-device modules; parallelism is applied from outside
(polytrain.distributed). Builders import lazily so `polytrain --help` stays fast.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.nn as nn

    from polytrain.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    presets: dict[str, dict[str, int]]
    """Size name -> model fields (dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size)."""
    module: str
    """Module that defines `build(cfg: ModelConfig) -> nn.Module`."""
    parallelize_module: str = ""
    """Module that defines `parallelize(model, dims, mesh)`: tensor parallelism from outside ("" = none)."""

    def build(self, cfg: ModelConfig) -> nn.Module:
        return importlib.import_module(self.module).build(cfg)

    def parallelize(self, model: nn.Module, dims, mesh):
        """Apply tensor/sequence parallelism (and dropout streams) to `model` on the meta device.

        Returns the tensor-parallel context, or None when tp = 1.
        """
        if not self.parallelize_module:
            if dims.tp > 1:
                from polytrain.config import ConfigError

                raise ConfigError(f"model.arch = '{model.cfg.arch}' has no tensor-parallel plan; "
                                  "set parallel.tp = 1")
            return None
        return importlib.import_module(self.parallelize_module).parallelize(model, dims, mesh)


def _preset(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size):
    return dict(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                ffn_dim=ffn_dim, vocab_size=vocab_size)


LLAMA_PRESETS = {
    "tiny": _preset(192, 4, 6, 2, 512, 4096),        # ~3.2M parameters
    "small": _preset(384, 6, 6, 2, 1024, 8192),      # ~16M
    "125m": _preset(768, 12, 12, 4, 2048, 32000),    # ~125M
    "350m": _preset(1024, 24, 16, 8, 2816, 32000),   # ~350M
    "1b": _preset(2048, 16, 32, 8, 8192, 32000),     # ~1.1B (Llama-3.2-1B shape)
    "7b": _preset(4096, 32, 32, 32, 11008, 32000),   # ~6.7B (Llama-2-7B shape)
}

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(presets=LLAMA_PRESETS, module="polytrain.models.llama.model",
                          parallelize_module="polytrain.models.llama.parallelize"),
}
