"""LoRA on state dicts: which keys are adapters, and merging a checkpoint's adapters into its weights."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from polytrain.config import LoRAConfig

ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
"""The names of a LoRALinear's adapter parameters, after its module name."""


def is_adapter_key(name: str) -> bool:
    """Whether a parameter / state-dict key names an adapter (A or B) rather than a base weight."""
    return name.endswith(ADAPTER_SUFFIXES)


def lora_record(cfg: LoRAConfig) -> dict[str, Any] | None:
    """What a checkpoint records of the adapters (trainer.json's "lora"), None without them."""
    return asdict(cfg) if cfg.rank else None


@torch.no_grad()
def merge_state(state: dict[str, torch.Tensor], lora: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`state` with every adapter pair fused into its base weight (W + alpha / r * B A, in fp32 or
    finer, cast back to W's dtype) and the adapter keys dropped; `lora` is the checkpoint's record."""
    scaling = lora["alpha"] / lora["rank"]
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for key in state:
        if key.endswith(".lora_a"):
            module = key.removesuffix(".lora_a")
            weight = out[module + ".weight"]
            at = torch.promote_types(weight.dtype, torch.float32)  # at least fp32, float64 kept
            a, b = state[key].to(at), state[module + ".lora_b"].to(at)  # (r, in), (out, r)
            out[module + ".weight"] = (weight.to(at) + scaling * (b @ a)).to(weight.dtype)
    return out
