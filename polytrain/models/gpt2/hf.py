"""GPT-2 <-> Hugging Face `GPT2LMHeadModel` (model_type "gpt2").

HF keeps OpenAI's Conv1D layout: weight (in, out), y = x W + b, with q, k and v
packed side by side in attn.c_attn ((dim, 3 dim)). polytrain's nn.Linear weight is
(out, in), so every projection is transposed, and c_attn is split into wq, wk, wv.
"""

from __future__ import annotations

import torch

from polytrain.config import ModelConfig
from polytrain.errors import ConfigError
from polytrain.io.hf_files import Converted, Reader
from polytrain.models.registry import model_config

ARCHITECTURE = "GPT2LMHeadModel"
PREFIXES = ("transformer.", "")  # GPT2LMHeadModel / GPT2Model checkpoints
IGNORE = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old checkpoints
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu"}


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """ModelConfig of a GPT-2 config.json; ConfigError for variants polytrain does not implement."""
    for key, bad in (("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False),
                     ("add_cross_attention", True)):
        if hf.get(key, not bad) == bad:
            raise ConfigError(f"GPT-2 with {key} = {str(bad).lower()} is not supported")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ConfigError(f"GPT-2 activation_function {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    dim, heads = hf["n_embd"], hf["n_head"]
    return model_config(
        "gpt2", dim=dim, n_layers=hf["n_layer"], n_heads=heads, n_kv_heads=heads,
        ffn_dim=hf.get("n_inner") or 4 * dim, vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=ACTIVATIONS[act],
        tie_embeddings=hf.get("tie_word_embeddings", True))


def config_to_hf(cfg: ModelConfig) -> dict:
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}[cfg.activation]
    return {"model_type": "gpt2", "architectures": [ARCHITECTURE], "n_embd": cfg.dim, "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads, "n_inner": cfg.ffn_dim, "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": act, "tie_word_embeddings": cfg.tie_embeddings,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}


def state_from_hf(read: Reader, cfg: ModelConfig) -> Converted:
    out = Converted(read)
    out["tok_embeddings.weight"] = read("wte.weight")
    out["pos_embeddings.weight"] = read("wpe.weight")
    for i in range(cfg.n_layers):
        hf, pt = f"h.{i}.", f"layers.{i}."
        for norm, hf_norm in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            for p in ("weight", "bias"):
                out[f"{pt}{norm}.{p}"] = read(f"{hf}{hf_norm}.{p}")
        # c_attn: weight (dim, 3 * dim) -> three (dim, dim) nn.Linear weights; bias (3 * dim,)
        for name, w in zip(("wq", "wk", "wv"), read(f"{hf}attn.c_attn.weight").t().chunk(3, dim=0)):
            out[f"{pt}attention.{name}.weight"] = w.contiguous()
        for name, b in zip(("wq", "wk", "wv"), read(f"{hf}attn.c_attn.bias").chunk(3)):
            out[f"{pt}attention.{name}.bias"] = b.contiguous()
        for ours, theirs in (("attention.wo", "attn.c_proj"), ("feed_forward.w1", "mlp.c_fc"),
                             ("feed_forward.w2", "mlp.c_proj")):
            out[f"{pt}{ours}.weight"] = read(f"{hf}{theirs}.weight").t().contiguous()
            out[f"{pt}{ours}.bias"] = read(f"{hf}{theirs}.bias")
    out["norm.weight"], out["norm.bias"] = read("ln_f.weight"), read("ln_f.bias")
    out.set_output("lm_head.weight", cfg.tie_embeddings)
    return out


def state_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    t = "transformer."
    out = {f"{t}wte.weight": sd["tok_embeddings.weight"], f"{t}wpe.weight": sd["pos_embeddings.weight"]}
    for i in range(cfg.n_layers):
        hf, pt = f"{t}h.{i}.", f"layers.{i}."
        for norm, hf_norm in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            for p in ("weight", "bias"):
                out[f"{hf}{hf_norm}.{p}"] = sd[f"{pt}{norm}.{p}"]
        qkv = [f"{pt}attention.{n}" for n in ("wq", "wk", "wv")]
        out[f"{hf}attn.c_attn.weight"] = torch.cat([sd[n + ".weight"] for n in qkv]).t().contiguous()
        out[f"{hf}attn.c_attn.bias"] = torch.cat([sd[n + ".bias"] for n in qkv])
        for ours, theirs in (("attention.wo", "attn.c_proj"), ("feed_forward.w1", "mlp.c_fc"),
                             ("feed_forward.w2", "mlp.c_proj")):
            out[f"{hf}{theirs}.weight"] = sd[f"{pt}{ours}.weight"].t().contiguous()
            out[f"{hf}{theirs}.bias"] = sd[f"{pt}{ours}.bias"]
    out[f"{t}ln_f.weight"], out[f"{t}ln_f.bias"] = sd["norm.weight"], sd["norm.bias"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    return out
