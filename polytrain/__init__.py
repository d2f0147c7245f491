"""polytrain: train large language models on any accelerator PyTorch drives."""

__version__ = "0.1.0"

# DeepSpeed-style entry points (polytrain.engine), imported on first use so that
# `import polytrain` stays light (no torch).
_ENGINE_API = ("initialize", "add_config_arguments", "init_distributed")


def __getattr__(name: str):
    if name == "load":  # (model, tokenizer) from a run, a checkpoint or a Hugging Face directory
        from polytrain.inference.load import load

        return load
    if name in _ENGINE_API:
        from polytrain import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'polytrain' has no attribute {name!r}")
