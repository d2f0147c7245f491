"""The model zoo: plain single-device modules, one directory per architecture, and their registry.

    from polytrain.models import ARCHITECTURES
    model = ARCHITECTURES["llama"].build(cfg.model)

registry.py holds the architectures (presets, defaults, the model checks); common/ the
shared layers; <arch>/model.py each model, <arch>/plan.py its tensor-parallel plan (data
that polytrain.distributed applies), <arch>/hf.py its Hugging Face names.
"""

from polytrain.models.registry import (
    ARCHITECTURES,
    SHAPE_FIELDS,
    Architecture,
    architecture,
    model_config,
)

__all__ = ["ARCHITECTURES", "SHAPE_FIELDS", "Architecture", "architecture", "model_config"]
