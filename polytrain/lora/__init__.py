"""Low-rank adapters (LoRA), applied to a plain model from outside it.

adapter.py: `LoRALinear`, `apply_lora` (which Linear layers the patterns pick, the frozen base,
the adapters' seeded initialisation), `merge_adapters` (fuse them into the base weights);
state.py: the same on state dicts (which keys are adapters, merging a checkpoint's tensors).
Tensor parallelism splits the adapters with their base weight (distributed/tensor_parallel/lora.py).
"""

from polytrain.lora.adapter import (
    LoRALinear,
    adapter_parameter_count,
    apply_lora,
    lora_update,
    merge_adapters,
    target_names,
)
from polytrain.lora.state import ADAPTER_SUFFIXES, is_adapter_key, lora_record, merge_state

__all__ = [
    "ADAPTER_SUFFIXES", "LoRALinear", "adapter_parameter_count", "apply_lora", "is_adapter_key",
    "lora_record", "lora_update", "merge_adapters", "merge_state", "target_names",
]
