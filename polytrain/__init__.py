"""polytrain: train large language models on any accelerator PyTorch drives."""

__version__ = "0.1.0"
