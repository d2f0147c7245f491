"""Model registry: architecture name -> size presets, defaults and a builder.

Models are plain single-device modules; parallelism is applied from outside
(polytrain.distributed). Builders import lazily so `polytrain --help` stays fast.

| arch      | kind            | positions          | norm            | feed-forward          | HF model_type |
| --------- | --------------- | ------------------ | --------------- | --------------------- | ------------- |
| llama     | decoder         | RoPE (+ scaling)   | RMSNorm, pre    | SwiGLU                | llama         |
| internlm2 | decoder         | RoPE (+ dynamic)   | RMSNorm, pre    | SwiGLU                | internlm2     |
| gpt2      | decoder         | learned            | LayerNorm, pre  | GELU (tanh)           | gpt2          |
| bert      | encoder (MLM)   | learned + segments | LayerNorm, post | GELU                  | bert          |
| t5        | encoder-decoder | relative buckets   | T5 RMS, pre     | ReLU or gated GELU    | t5            |
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

    from polytrain.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    presets: dict[str, dict[str, int]]
    """Size name -> model fields (dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, ...)."""
    module: str
    """Module that defines `build(cfg: ModelConfig) -> nn.Module`."""
    parallelize_module: str = ""
    """Module that defines `parallelize(model, dims, mesh)`: tensor parallelism from outside ("" = none)."""
    kind: str = "decoder"
    """decoder (causal LM), encoder (masked LM) or encoder-decoder."""
    rope: bool = True
    """Rotary positions (the rope_* fields apply)."""
    gated: bool | None = True
    """Feed-forward always gated (True), never (False), or as model.gated_ffn says (None)."""
    gqa: bool = True
    """Grouped-query attention (n_kv_heads < n_heads) is possible."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """ModelConfig fields this architecture sets before the user's TOML and overrides."""
    hf_model_types: tuple[str, ...] = ()
    """Hugging Face config.json model_type values `polytrain convert` maps to this architecture."""
    tp_shares_kv_heads: bool = True
    """Tensor parallelism may exceed n_kv_heads (each KV head then replicated on tp / n_kv_heads ranks)."""
    embedding_units: tuple[str, ...] = ("tok_embeddings",)
    """Top-level modules before the blocks: the first pipeline stage holds them all."""
    head_units: tuple[str, ...] = ("norm", "output")
    """Top-level modules after the blocks, in forward order: the last pipeline stage ends with them."""

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

    def hf(self):
        """The module with this architecture's Hugging Face mapping (config and tensor names)."""
        return importlib.import_module(self.module.rsplit(".", 1)[0] + ".hf")


def _preset(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, **extra):
    """n_kv_heads None: left out, so it follows n_heads (architectures without grouped-query attention)."""
    kv = {} if n_kv_heads is None else {"n_kv_heads": n_kv_heads}
    return dict(dim=dim, n_layers=n_layers, n_heads=n_heads, **kv, ffn_dim=ffn_dim, vocab_size=vocab_size,
                **extra)


LLAMA_PRESETS = {
    "tiny": _preset(192, 4, 6, 2, 512, 4096),        # ~3.2M parameters
    "small": _preset(384, 6, 6, 2, 1024, 8192),      # ~16M
    "125m": _preset(768, 12, 12, 4, 2048, 32000),    # ~125M
    "350m": _preset(1024, 24, 16, 8, 2816, 32000),   # ~350M
    "1b": _preset(2048, 16, 32, 8, 8192, 32000),     # ~1.1B (Llama-3.2-1B shape)
    "7b": _preset(4096, 32, 32, 32, 11008, 32000),   # ~6.7B (Llama-2-7B shape)
}

INTERNLM2_PRESETS = {
    "tiny": _preset(192, 4, 6, 2, 512, 4096),
    "small": _preset(384, 6, 6, 2, 1024, 8192),
    "1.8b": _preset(2048, 24, 16, 8, 8192, 92544),   # internlm2-1_8b shape
    "7b": _preset(4096, 32, 32, 8, 14336, 92544),    # internlm2-7b shape
    "20b": _preset(6144, 48, 48, 8, 16384, 92544),   # internlm2-20b shape
}

GPT2_PRESETS = {
    "tiny": _preset(192, 4, 6, None, 768, 4096),
    "small": _preset(384, 6, 6, None, 1536, 8192),
    "124m": _preset(768, 12, 12, None, 3072, 50257),   # GPT-2
    "355m": _preset(1024, 24, 16, None, 4096, 50257),  # GPT-2 medium
    "774m": _preset(1280, 36, 20, None, 5120, 50257),  # GPT-2 large
    "1.5b": _preset(1600, 48, 25, None, 6400, 50257),  # GPT-2 XL
}

BERT_PRESETS = {
    "tiny": _preset(192, 4, 6, None, 768, 4096),
    "small": _preset(384, 6, 6, None, 1536, 8192),
    "base": _preset(768, 12, 12, None, 3072, 30522),   # bert-base
    "large": _preset(1024, 24, 16, None, 4096, 30522),  # bert-large
}

T5_PRESETS = {  # n_layers counts the encoder's blocks; the decoder has as many
    "tiny": _preset(192, 4, 6, None, 512, 4096),
    "small": _preset(512, 8, 6, None, 1024, 32128, head_dim=64),     # t5-v1_1-small shape
    "base": _preset(768, 12, 12, None, 2048, 32128, head_dim=64),   # t5-v1_1-base shape
    "large": _preset(1024, 24, 16, None, 2816, 32128, head_dim=64),  # t5-v1_1-large shape
}

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(presets=LLAMA_PRESETS, module="polytrain.models.llama.model",
                          parallelize_module="polytrain.models.llama.parallelize", hf_model_types=("llama",)),
    "internlm2": Architecture(presets=INTERNLM2_PRESETS, module="polytrain.models.internlm2.model",
                              parallelize_module="polytrain.models.internlm2.parallelize",
                              tp_shares_kv_heads=False,  # wqkv splits by whole KV groups
                              defaults={"rope_theta": 1_000_000.0}, hf_model_types=("internlm2",)),
    "gpt2": Architecture(presets=GPT2_PRESETS, module="polytrain.models.gpt2.model", rope=False,
                         parallelize_module="polytrain.models.gpt2.parallelize",
                         embedding_units=("tok_embeddings", "pos_embeddings"),
                         gated=False, gqa=False, hf_model_types=("gpt2",),
                         defaults={"activation": "gelu_tanh", "gated_ffn": False, "tie_embeddings": True}),
    "bert": Architecture(presets=BERT_PRESETS, module="polytrain.models.bert.model", kind="encoder",
                         parallelize_module="polytrain.models.bert.parallelize",
                         rope=False, gated=False, gqa=False, hf_model_types=("bert",),
                         defaults={"activation": "gelu", "gated_ffn": False, "tie_embeddings": True,
                                   "norm_eps": 1e-12}),
    # T5 v1.1 by default: gated GELU, untied output; v1.0 = activation relu, gated_ffn false,
    # tie_embeddings true, output_scale true.
    "t5": Architecture(presets=T5_PRESETS, module="polytrain.models.t5.model", kind="encoder-decoder",
                       parallelize_module="polytrain.models.t5.parallelize",
                       rope=False, gated=None, gqa=False, hf_model_types=("t5",),
                       defaults={"activation": "gelu_tanh", "gated_ffn": True, "tie_embeddings": False,
                                 "norm_eps": 1e-6}),
}
