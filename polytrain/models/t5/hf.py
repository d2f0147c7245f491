"""T5 <-> Hugging Face `T5ForConditionalGeneration` (model_type "t5").

HF numbers encoder and decoder blocks separately (encoder.block.i, decoder.block.j);
polytrain's one `layers` dict puts decoder block j at L_enc + j. Sub-layers are
indexed: layer.0 self-attention, then (decoder) layer.1 cross-attention, then the
feed-forward. The relative-position table lives in block 0 of each stack in HF and
at the top level here (every block of the stack uses it).

Tying and scaling: the output projection is untied exactly when the checkpoint holds
`lm_head.weight` (T5 v1.1); the decoder output is scaled by dim ** -0.5 unless the
config says tie_word_embeddings = false or scale_decoder_outputs = false (v1.1).
"""

from __future__ import annotations

import torch

from polytrain.config import ModelConfig
from polytrain.errors import ConfigError
from polytrain.io.hf_files import Converted, Reader
from polytrain.models.registry import model_config

ARCHITECTURE = "T5ForConditionalGeneration"
PREFIXES = ("",)
IGNORE = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
          "EncDecAttention.relative_attention_bias")  # tied copies; a table HF never uses
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "silu": "silu"}
_ATTN = (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))


def config_from_hf(hf: dict, names: set[str]) -> ModelConfig:
    """ModelConfig of a T5 config.json (and, for tying, the checkpoint's tensor names)."""
    proj = hf.get("feed_forward_proj", "relu")
    gated, _, act = proj.rpartition("-")
    if gated not in ("", "gated") or act not in ACTIVATIONS:
        raise ConfigError(f"T5 feed_forward_proj {proj!r} is not supported (relu, gated-gelu, ...)")
    # HF's historical rule: "gated-gelu" means the tanh approximation; a plain "gelu" is exact.
    activation = "gelu_tanh" if proj == "gated-gelu" else ACTIVATIONS[act]
    dim, heads, d_kv = hf["d_model"], hf["num_heads"], hf["d_kv"]
    n_layers = hf["num_layers"]
    n_decoder = hf.get("num_decoder_layers") or n_layers
    scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    return model_config(
        "t5", dim=dim, n_layers=n_layers, n_decoder_layers=0 if n_decoder == n_layers else n_decoder,
        n_heads=heads, n_kv_heads=heads, head_dim=0 if d_kv * heads == dim else d_kv, ffn_dim=hf["d_ff"],
        vocab_size=hf["vocab_size"], max_seq_len=hf.get("n_positions", 512),
        rel_pos_buckets=hf.get("relative_attention_num_buckets", 32),
        rel_pos_max_distance=hf.get("relative_attention_max_distance", 128),
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), activation=activation, gated_ffn=bool(gated),
        tie_embeddings="lm_head.weight" not in names, output_scale=bool(scale))


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.gated_ffn:
        if cfg.activation == "gelu":
            raise ConfigError("T5's config cannot express a gated exact GELU ('gated-gelu' means the tanh "
                              "approximation); use model.activation = 'gelu_tanh'")
        proj = "gated-" + {"gelu_tanh": "gelu", "relu": "relu", "silu": "silu"}[cfg.activation]
    else:
        proj = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}[cfg.activation]
    hd = cfg.head_dim or cfg.dim // cfg.n_heads
    return {"model_type": "t5", "architectures": [ARCHITECTURE], "is_encoder_decoder": True,
            "d_model": cfg.dim, "d_kv": hd, "d_ff": cfg.ffn_dim, "num_layers": cfg.n_layers,
            "num_decoder_layers": cfg.n_decoder_layers or cfg.n_layers, "num_heads": cfg.n_heads,
            "vocab_size": cfg.vocab_size, "relative_attention_num_buckets": cfg.rel_pos_buckets,
            "relative_attention_max_distance": cfg.rel_pos_max_distance, "layer_norm_epsilon": cfg.norm_eps,
            "feed_forward_proj": proj, "tie_word_embeddings": cfg.output_scale,
            "scale_decoder_outputs": cfg.output_scale, "n_positions": cfg.max_seq_len}


def _blocks(cfg: ModelConfig):
    """(polytrain block prefix, HF block prefix, HF index of the feed-forward sub-layer, decoder?)."""
    for i in range(cfg.n_layers):
        yield f"layers.{i}.", f"encoder.block.{i}.", 1, False
    for j in range(cfg.n_decoder_layers or cfg.n_layers):
        yield f"layers.{cfg.n_layers + j}.", f"decoder.block.{j}.", 2, True


def _ffn(cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
    if cfg.gated_ffn:
        return (("w1", "wi_0"), ("w3", "wi_1"), ("w2", "wo"))
    return (("w1", "wi"), ("w2", "wo"))


def _pairs(cfg: ModelConfig):
    """(polytrain name, HF name) of every tensor, the shared embedding and output excepted."""
    for stack in ("encoder", "decoder"):
        yield (f"{stack}_pos_bias.weight",
               f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        yield f"{stack}_norm.weight", f"{stack}.final_layer_norm.weight"
    for pt, hf, ff, decoder in _blocks(cfg):
        yield f"{pt}attention_norm.weight", f"{hf}layer.0.layer_norm.weight"
        for ours, theirs in _ATTN:
            yield f"{pt}attention.{ours}.weight", f"{hf}layer.0.SelfAttention.{theirs}.weight"
        if decoder:
            yield f"{pt}cross_attention_norm.weight", f"{hf}layer.1.layer_norm.weight"
            for ours, theirs in _ATTN:
                yield f"{pt}cross_attention.{ours}.weight", f"{hf}layer.1.EncDecAttention.{theirs}.weight"
        yield f"{pt}ffn_norm.weight", f"{hf}layer.{ff}.layer_norm.weight"
        for ours, theirs in _ffn(cfg):
            yield f"{pt}feed_forward.{ours}.weight", f"{hf}layer.{ff}.DenseReluDense.{theirs}.weight"


def state_from_hf(read: Reader, cfg: ModelConfig) -> Converted:
    out = Converted(read)
    out["tok_embeddings.weight"] = read("shared.weight")
    for ours, theirs in _pairs(cfg):
        out[ours] = read(theirs)
    if not cfg.tie_embeddings:
        out["output.weight"] = read("lm_head.weight")
    return out


def state_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"shared.weight": sd["tok_embeddings.weight"]}
    out.update({theirs: sd[ours] for ours, theirs in _pairs(cfg)})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    return out
