"""BERT <-> Hugging Face `BertForMaskedLM` (model_type "bert").

Checkpoints saved from BertForPreTraining also hold the pooler and the
next-sentence head: polytrain's BERT has neither (it pre-trains with masked LM
only), so those tensors are left out on import. Old TensorFlow-converted files name
LayerNorm parameters gamma/beta; both spellings are read.
"""

from __future__ import annotations

import torch

from polytrain.config import ModelConfig
from polytrain.errors import ConfigError
from polytrain.io.hf_files import Converted, Reader
from polytrain.models.registry import model_config

ARCHITECTURE = "BertForMaskedLM"
PREFIXES = ("bert.", "")
IGNORE = ("embeddings.position_ids", "pooler.", "cls.seq_relationship.", "cls.predictions.decoder.bias")
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu"}
_LINEARS = (("attention.wq", "attention.self.query"), ("attention.wk", "attention.self.key"),
            ("attention.wv", "attention.self.value"), ("attention.wo", "attention.output.dense"),
            ("feed_forward.w1", "intermediate.dense"), ("feed_forward.w2", "output.dense"))
_NORMS = (("attention_norm", "attention.output.LayerNorm"), ("ffn_norm", "output.LayerNorm"))


def config_from_hf(hf: dict, names: set[str] = frozenset()) -> ModelConfig:
    """ModelConfig of a BERT config.json; ConfigError for variants polytrain does not implement."""
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"BERT with position_embedding_type {hf['position_embedding_type']!r} is not "
                          "supported (absolute is)")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ConfigError("BERT as a decoder (is_decoder / add_cross_attention) is not supported")
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"BERT hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    heads = hf["num_attention_heads"]
    return model_config(
        "bert", dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads, n_kv_heads=heads,
        ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_seq_len=hf.get("max_position_embeddings", 512), type_vocab_size=hf.get("type_vocab_size", 2),
        norm_eps=hf.get("layer_norm_eps", 1e-12), activation=ACTIVATIONS[act],
        tie_embeddings=hf.get("tie_word_embeddings", True))


def config_to_hf(cfg: ModelConfig) -> dict:
    act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[cfg.activation]
    return {"model_type": "bert", "architectures": [ARCHITECTURE], "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "intermediate_size": cfg.ffn_dim, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_seq_len, "type_vocab_size": cfg.type_vocab_size,
            "layer_norm_eps": cfg.norm_eps, "hidden_act": act, "tie_word_embeddings": cfg.tie_embeddings,
            "position_embedding_type": "absolute"}


def _norm(read: Reader, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of a LayerNorm saved as weight/bias or, TensorFlow-style, gamma/beta."""
    if read.has(f"{name}.weight") or not read.has(f"{name}.gamma"):
        return read(f"{name}.weight"), read(f"{name}.bias")
    return read(f"{name}.gamma"), read(f"{name}.beta")


def state_from_hf(read: Reader, cfg: ModelConfig) -> Converted:
    out = Converted(read)
    out["tok_embeddings.weight"] = read("embeddings.word_embeddings.weight")
    out["pos_embeddings.weight"] = read("embeddings.position_embeddings.weight")
    out["type_embeddings.weight"] = read("embeddings.token_type_embeddings.weight")
    out["embed_norm.weight"], out["embed_norm.bias"] = _norm(read, "embeddings.LayerNorm")
    for i in range(cfg.n_layers):
        hf, pt = f"encoder.layer.{i}.", f"layers.{i}."
        for ours, theirs in _LINEARS:
            out[f"{pt}{ours}.weight"] = read(f"{hf}{theirs}.weight")
            out[f"{pt}{ours}.bias"] = read(f"{hf}{theirs}.bias")
        for ours, theirs in _NORMS:
            out[f"{pt}{ours}.weight"], out[f"{pt}{ours}.bias"] = _norm(read, hf + theirs)
    out["head_dense.weight"] = read("cls.predictions.transform.dense.weight")
    out["head_dense.bias"] = read("cls.predictions.transform.dense.bias")
    out["head_norm.weight"], out["head_norm.bias"] = _norm(read, "cls.predictions.transform.LayerNorm")
    out["output.bias"] = read("cls.predictions.bias")
    out.set_output("cls.predictions.decoder.weight", cfg.tie_embeddings)
    return out


def state_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    b = "bert."
    out = {f"{b}embeddings.word_embeddings.weight": sd["tok_embeddings.weight"],
           f"{b}embeddings.position_embeddings.weight": sd["pos_embeddings.weight"],
           f"{b}embeddings.token_type_embeddings.weight": sd["type_embeddings.weight"],
           f"{b}embeddings.LayerNorm.weight": sd["embed_norm.weight"],
           f"{b}embeddings.LayerNorm.bias": sd["embed_norm.bias"]}
    for i in range(cfg.n_layers):
        hf, pt = f"{b}encoder.layer.{i}.", f"layers.{i}."
        for ours, theirs in _LINEARS + _NORMS:
            out[f"{hf}{theirs}.weight"] = sd[f"{pt}{ours}.weight"]
            out[f"{hf}{theirs}.bias"] = sd[f"{pt}{ours}.bias"]
    out["cls.predictions.transform.dense.weight"] = sd["head_dense.weight"]
    out["cls.predictions.transform.dense.bias"] = sd["head_dense.bias"]
    out["cls.predictions.transform.LayerNorm.weight"] = sd["head_norm.weight"]
    out["cls.predictions.transform.LayerNorm.bias"] = sd["head_norm.bias"]
    out["cls.predictions.bias"] = sd["output.bias"]
    if not cfg.tie_embeddings:
        out["cls.predictions.decoder.weight"] = sd["output.weight"]
    return out
