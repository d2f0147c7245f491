"""One typed config tree: the schema (schema.py) and its loader (load.py).

    cfg = load_config("configs/llama_tiny.toml", ["--train.lr", "1e-3"])
    cfg.train.lr, cfg.parallel.zero, cfg.run_dir

Sections: run, model, data, train, parallel, checkpoint; `polytrain train --help` lists every key.
"""

from polytrain.config.load import (
    help_text,
    load_config,
    parse_overrides,
    to_dict,
    to_toml,
    validate,
)
from polytrain.config.schema import (
    SECTIONS,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "SECTIONS", "CheckpointConfig", "Config", "DataConfig", "ModelConfig", "ParallelConfig", "RunConfig",
    "TrainConfig", "help_text", "load_config", "parse_overrides", "to_dict", "to_toml", "validate",
]
