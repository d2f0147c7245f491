"""Llama <-> Hugging Face `LlamaForCausalLM` (model_type "llama").

Names map one to one (q_proj -> attention.wq, gate_proj -> feed_forward.w1, up_proj
-> w3, down_proj -> w2, input_layernorm -> attention_norm, ...); both use the
rotate-half RoPE layout, so no tensor is permuted. RoPE settings are read from either
config style: transformers 4's `rope_theta` + `rope_scaling`, or 5's `rope_parameters`;
they are written in the first, which both versions read.
"""

from __future__ import annotations

import torch

from polytrain.config import ModelConfig
from polytrain.errors import ConfigError
from polytrain.io.hf_files import Converted, Reader
from polytrain.models.registry import model_config

ARCHITECTURE = "LlamaForCausalLM"
PREFIXES = ("model.", "")
IGNORE = ("rotary_emb.inv_freq",)  # a buffer some old checkpoints saved
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_BLOCK = (("attention.wq", "self_attn.q_proj"), ("attention.wk", "self_attn.k_proj"),
          ("attention.wv", "self_attn.v_proj"), ("attention.wo", "self_attn.o_proj"),
          ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w3", "mlp.up_proj"),
          ("feed_forward.w2", "mlp.down_proj"), ("attention_norm", "input_layernorm"),
          ("ffn_norm", "post_attention_layernorm"))


def rope_from_hf(hf: dict, family: str) -> dict:
    """ModelConfig rope_* fields and max_seq_len from either transformers config style."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    source = params if "rope_type" in params else scaling
    max_pos = hf.get("max_position_embeddings", 2048)
    fields = {"rope_theta": float(theta), "max_seq_len": max_pos}
    if kind == "default":
        return fields
    if kind not in ("linear", "dynamic", "llama3"):
        raise ConfigError(f"{family} RoPE scaling {kind!r} is not supported (linear, dynamic, llama3 are)")
    fields.update(rope_scaling=kind, rope_scaling_factor=float(source["factor"]))
    if kind == "dynamic":  # the base grows past max_position_embeddings; allow factor x that
        fields.update(rope_original_max_len=max_pos, max_seq_len=int(max_pos * fields["rope_scaling_factor"]))
    if kind == "llama3":
        fields.update(rope_low_freq_factor=float(source["low_freq_factor"]),
                      rope_high_freq_factor=float(source["high_freq_factor"]),
                      rope_original_max_len=int(source["original_max_position_embeddings"]))
    return fields


def rope_to_hf(cfg: ModelConfig) -> dict:
    """rope_theta, rope_scaling and max_position_embeddings in transformers 4's style."""
    out = {"rope_theta": cfg.rope_theta, "rope_scaling": None, "max_position_embeddings": cfg.max_seq_len}
    if cfg.rope_scaling == "none":
        return out
    scaling = {"rope_type": cfg.rope_scaling, "type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling == "dynamic":
        out["max_position_embeddings"] = cfg.rope_original_max_len or cfg.max_seq_len
    if cfg.rope_scaling == "llama3":
        scaling.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                       original_max_position_embeddings=cfg.rope_original_max_len or cfg.max_seq_len)
    out["rope_scaling"] = scaling
    return out


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """ModelConfig of a Llama config.json; ConfigError for variants polytrain does not implement."""
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"Llama with {key} = true is not supported")
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"Llama hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    hd = hf.get("head_dim") or dim // heads
    return model_config(
        "llama", dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], head_dim=0 if hd * heads == dim else hd,
        norm_eps=hf.get("rms_norm_eps", 1e-6), activation=ACTIVATIONS[act],
        tie_embeddings=hf.get("tie_word_embeddings", False), **rope_from_hf(hf, "Llama"))


def config_to_hf(cfg: ModelConfig) -> dict:
    act = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}[cfg.activation]
    return {"model_type": "llama", "architectures": [ARCHITECTURE], "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim,
            "head_dim": cfg.head_dim or cfg.dim // cfg.n_heads, "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.norm_eps, "hidden_act": act, "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": False, "mlp_bias": False, **rope_to_hf(cfg)}


def state_from_hf(read: Reader, cfg: ModelConfig) -> Converted:
    out = Converted(read)
    out["tok_embeddings.weight"] = read("embed_tokens.weight")
    for i in range(cfg.n_layers):
        for ours, theirs in _BLOCK:
            out[f"layers.{i}.{ours}.weight"] = read(f"layers.{i}.{theirs}.weight")
    out["norm.weight"] = read("norm.weight")
    out.set_output("lm_head.weight", cfg.tie_embeddings)
    return out


def state_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"]}
    for i in range(cfg.n_layers):
        for ours, theirs in _BLOCK:
            out[f"model.layers.{i}.{theirs}.weight"] = sd[f"layers.{i}.{ours}.weight"]
    out["model.norm.weight"] = sd["norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    return out
