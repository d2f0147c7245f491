"""InternLM2 <-> its Hugging Face remote-code checkpoints (model_type "internlm2").

transformers has no built-in InternLM2: its checkpoints load with trust_remote_code
through the configuration_internlm2.py / modeling_internlm2.py files shipped in the
model's repository. polytrain's module names are InternLM2's own, so tensors map by
name: `model.` + name, except `output.weight`, with wqkv in the same grouped layout.
The exported config.json carries the `auto_map` that remote code expects; the two
.py files are copied back when the imported directory had them (polytrain does not
ship them).
"""

from __future__ import annotations

import torch

from polytrain.config import ModelConfig
from polytrain.errors import ConfigError
from polytrain.io.hf_files import Converted, Reader
from polytrain.models.llama.hf import ACTIVATIONS, rope_from_hf
from polytrain.models.registry import model_config

ARCHITECTURE = "InternLM2ForCausalLM"
PREFIXES = ("model.", "")
IGNORE = ("rotary_emb.inv_freq",)
AUTO_MAP = {"AutoConfig": "configuration_internlm2.InternLM2Config",
            "AutoModel": "modeling_internlm2.InternLM2ForCausalLM",
            "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"}
_BLOCK = ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2",
          "attention_norm", "ffn_norm")


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """ModelConfig of an InternLM2 config.json; ConfigError for variants polytrain does not implement."""
    if hf.get("bias", True):  # the remote code's default; released checkpoints set false
        raise ConfigError("InternLM2 with bias = true (biases on wqkv and wo) is not supported; "
                          "released InternLM2 checkpoints have bias = false")
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"InternLM2 hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    heads = hf["num_attention_heads"]
    rope = rope_from_hf(hf, "InternLM2")
    if rope.get("rope_scaling") == "llama3":
        raise ConfigError("InternLM2's remote code has no llama3 RoPE scaling")
    return model_config(
        "internlm2", dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], norm_eps=hf.get("rms_norm_eps", 1e-6), activation=ACTIVATIONS[act],
        tie_embeddings=hf.get("tie_word_embeddings", False), **rope)


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.rope_scaling == "llama3" or cfg.head_dim not in (0, cfg.dim // cfg.n_heads):
        raise ConfigError("InternLM2's remote code supports neither llama3 RoPE scaling nor a "
                          "head_dim other than dim / n_heads")
    rope = {"rope_theta": cfg.rope_theta, "rope_scaling": None, "max_position_embeddings": cfg.max_seq_len}
    if cfg.rope_scaling != "none":
        rope["rope_scaling"] = {"type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor}
        if cfg.rope_scaling == "dynamic":
            rope["max_position_embeddings"] = cfg.rope_original_max_len or cfg.max_seq_len
    act = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}[cfg.activation]
    return {"model_type": "internlm2", "architectures": [ARCHITECTURE], "auto_map": AUTO_MAP,
            "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps, "hidden_act": act, "bias": False,
            "tie_word_embeddings": cfg.tie_embeddings, **rope}


def state_from_hf(read: Reader, cfg: ModelConfig) -> Converted:
    out = Converted(read)
    out["tok_embeddings.weight"] = read("tok_embeddings.weight")
    for i in range(cfg.n_layers):
        for name in _BLOCK:
            out[f"layers.{i}.{name}.weight"] = read(f"layers.{i}.{name}.weight")
    out["norm.weight"] = read("norm.weight")
    out.set_output("output.weight", cfg.tie_embeddings)
    return out


def state_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"model.tok_embeddings.weight": sd["tok_embeddings.weight"]}
    for i in range(cfg.n_layers):
        for name in _BLOCK:
            out[f"model.layers.{i}.{name}.weight"] = sd[f"layers.{i}.{name}.weight"]
    out["model.norm.weight"] = sd["norm.weight"]
    if not cfg.tie_embeddings:
        out["output.weight"] = sd["output.weight"]
    return out
