"""DeepSpeed compatibility: run `polytrain train` from an existing ds_config.json."""

from polytrain.deepspeed.config import (
    DeepSpeedConfigWarning,
    DSConfig,
    LossScaling,
    OptimizerSpec,
    load_ds_config,
    to_overrides,
)
from polytrain.optim.warmup_schedules import (
    Schedule,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    schedule_from_train,
)

__all__ = [
    "DSConfig",
    "DeepSpeedConfigWarning",
    "LossScaling",
    "OptimizerSpec",
    "Schedule",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "load_ds_config",
    "schedule_from_train",
    "to_overrides",
]
