"""Model registry: architecture name -> size presets, defaults, a builder, and the model checks.

Models are plain single-device modules; parallelism is applied from outside
(polytrain.distributed), driven by each architecture's declarative plan. Builders import
lazily so `polytrain --help` stays fast. The config loader asks this module to fill in
what the architecture decides (`resolve_model`: defaults for keys nobody set, the size
preset) and to check the model fields.

| arch      | kind            | positions          | norm            | feed-forward          | HF model_type |
| --------- | --------------- | ------------------ | --------------- | --------------------- | ------------- |
| llama     | decoder         | RoPE (+ scaling)   | RMSNorm, pre    | SwiGLU                | llama         |
| internlm2 | decoder         | RoPE (+ dynamic)   | RMSNorm, pre    | SwiGLU                | internlm2     |
| gpt2      | decoder         | learned            | LayerNorm, pre  | GELU (tanh)           | gpt2          |
| bert      | encoder (MLM)   | learned + segments | LayerNorm, post | GELU                  | bert          |
| t5        | encoder-decoder | relative buckets   | T5 RMS, pre     | ReLU or gated GELU    | t5            |
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polytrain.config.schema import Config, ModelConfig
from polytrain.errors import ConfigError

if TYPE_CHECKING:
    import torch.nn as nn

    from polytrain.models.common.plan import Plan

# Fields that decide parameter shapes: a checkpoint only loads into a model that agrees on them.
SHAPE_FIELDS = ("arch", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")
# The pre-training objective each kind of model learns by (train.objective = "auto").
OBJECTIVE_OF_KIND = {"decoder": "causal", "encoder": "mlm", "encoder-decoder": "span"}


@dataclass(frozen=True)
class Architecture:
    presets: dict[str, dict[str, int]]
    """Size name -> model fields (dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, ...)."""
    module: str
    """Module that defines `build(cfg: ModelConfig) -> nn.Module`."""
    plan_module: str = ""
    """Module that defines `tp_plan(cfg) -> Plan`: how tensor parallelism splits it ("" = no plan)."""
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
    decoder_start: int | None = None
    """encoder-decoder: the token id the decoder's input starts with."""

    def build(self, cfg: ModelConfig) -> nn.Module:
        """The model of `cfg`; with `head = "value"` its output projection is a scalar head."""
        model = importlib.import_module(self.module).build(cfg)
        if cfg.head == "value":
            from polytrain.models.common.value_head import attach_scalar_head

            attach_scalar_head(model)
        return model

    def tp_plan(self, cfg: ModelConfig) -> Plan:
        """Module-name patterns -> tensor-parallel roles for a model of this architecture.

        A value model's (1, dim) head is replicated (ScalarOutput) where a language model's
        head is split by vocabulary."""
        if not self.plan_module:
            raise ConfigError(f"model.arch = '{cfg.arch}' has no tensor-parallel plan; set parallel.tp = 1")
        plan = importlib.import_module(self.plan_module).tp_plan(cfg)
        if cfg.head == "value":
            from polytrain.models.common.plan import ScalarOutput

            plan = {**plan, "output": ScalarOutput()}
        return plan

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
                          plan_module="polytrain.models.llama.plan", hf_model_types=("llama",)),
    "internlm2": Architecture(presets=INTERNLM2_PRESETS, module="polytrain.models.internlm2.model",
                              plan_module="polytrain.models.internlm2.plan",
                              tp_shares_kv_heads=False,  # wqkv splits by whole KV groups
                              defaults={"rope_theta": 1_000_000.0}, hf_model_types=("internlm2",)),
    "gpt2": Architecture(presets=GPT2_PRESETS, module="polytrain.models.gpt2.model", rope=False,
                         plan_module="polytrain.models.gpt2.plan",
                         embedding_units=("tok_embeddings", "pos_embeddings"),
                         gated=False, gqa=False, hf_model_types=("gpt2",),
                         defaults={"activation": "gelu_tanh", "gated_ffn": False, "tie_embeddings": True}),
    "bert": Architecture(presets=BERT_PRESETS, module="polytrain.models.bert.model", kind="encoder",
                         plan_module="polytrain.models.bert.plan",
                         rope=False, gated=False, gqa=False, hf_model_types=("bert",),
                         defaults={"activation": "gelu", "gated_ffn": False, "tie_embeddings": True,
                                   "norm_eps": 1e-12}),
    # T5 v1.1 by default: gated GELU, untied output; v1.0 = activation relu, gated_ffn false,
    # tie_embeddings true, output_scale true.
    "t5": Architecture(presets=T5_PRESETS, module="polytrain.models.t5.model", kind="encoder-decoder",
                       decoder_start=0, plan_module="polytrain.models.t5.plan",
                       rope=False, gated=None, gqa=False, hf_model_types=("t5",),
                       defaults={"activation": "gelu_tanh", "gated_ffn": True, "tie_embeddings": False,
                                 "norm_eps": 1e-6}),
}


def architecture(name: str) -> Architecture:
    """The registry entry of `name`, or one line naming the known architectures."""
    if name not in ARCHITECTURES:
        close = difflib.get_close_matches(name, ARCHITECTURES, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"model.arch = '{name}' is not a known architecture "
                          f"(known: {', '.join(ARCHITECTURES)}){hint}")
    return ARCHITECTURES[name]


def model_config(arch: str, **fields_: Any) -> ModelConfig:
    """A ModelConfig of `arch` with its architecture defaults, then `fields_` (unresolved, unvalidated)."""
    return ModelConfig(**{**dataclasses.asdict(ModelConfig()), **ARCHITECTURES[arch].defaults,
                          "arch": arch, **fields_})


def shape_config(m: ModelConfig) -> dict[str, Any]:
    """The fields that decide parameter shapes (what a checkpoint's model must agree on).

    `head` is named only for value models, so language models' checkpoints written before
    the key existed still match."""
    shape = {k: getattr(m, k) for k in SHAPE_FIELDS}
    return {**shape, "head": m.head} if m.head != "lm" else shape


def apply_defaults(cfg: Config) -> None:
    """Set the architecture's defaults (gpt2's GELU, ...) on the model keys the user did not set
    (`cfg.set_keys`), in place."""
    arch = architecture(cfg.model.arch)
    for name, value in arch.defaults.items():
        # A value head has its own weight: the architecture's tying does not apply to it.
        if f"model.{name}" not in cfg.set_keys and not (name == "tie_embeddings" and cfg.model.head == "value"):
            setattr(cfg.model, name, value)


def resolve_model(cfg: Config) -> None:
    """Fill the model fields left at 0 from the size preset, then check the model fields; in place."""
    m = cfg.model
    presets = architecture(m.arch).presets
    if m.size == "custom":  # every field given (e.g. a converted model); the checks find any left at 0
        presets = {"custom": {}}
    if m.size not in presets:
        raise ConfigError(f"model.size = '{m.size}' is not a preset of {m.arch}; choose one of {', '.join(presets)}")
    for name, value in presets[m.size].items():
        if getattr(m, name) == 0:
            setattr(m, name, value)
    if m.n_kv_heads == 0:
        m.n_kv_heads = m.n_heads
    if m.max_seq_len == 0:
        m.max_seq_len = cfg.data.seq_len
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key} = {getattr(m, key)} must be positive")
    check_model(m)
    objective_name(cfg)  # the objective must fit the architecture


def objective_name(cfg: Config) -> str:
    """train.objective, with "auto" resolved from the architecture's kind."""
    kind = ARCHITECTURES[cfg.model.arch].kind
    name = cfg.train.objective if cfg.train.objective != "auto" else OBJECTIVE_OF_KIND[kind]
    if name != OBJECTIVE_OF_KIND[kind]:
        raise ConfigError(f"train.objective = '{name}' does not fit {cfg.model.arch} (an {kind} model); "
                          f"use '{OBJECTIVE_OF_KIND[kind]}' or 'auto'")
    return name


def check_model(m: ModelConfig) -> None:
    """Head geometry, and the fields that only some architectures have."""
    arch = architecture(m.arch)
    if m.head_dim < 0:
        raise ConfigError(f"model.head_dim = {m.head_dim} must be >= 0 (0 = dim / n_heads)")
    if m.head_dim == 0 and m.dim % m.n_heads:
        raise ConfigError(f"model.dim = {m.dim} must be a multiple of model.n_heads = {m.n_heads} "
                          "(or set model.head_dim)")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads = {m.n_kv_heads} must divide model.n_heads = {m.n_heads}")
    if not arch.gqa and m.n_kv_heads != m.n_heads:
        raise ConfigError(f"model.n_kv_heads = {m.n_kv_heads}: {m.arch} has no grouped-query attention; "
                          f"set it to model.n_heads = {m.n_heads}")
    head_dim = m.head_dim or m.dim // m.n_heads
    if arch.rope and head_dim % 2:
        raise ConfigError(f"head dim model.dim / model.n_heads = {head_dim} must be even for RoPE")
    if arch.gated is not None and m.gated_ffn != arch.gated:
        form = "gated (act(w1 x) * w3 x)" if arch.gated else "not gated"
        raise ConfigError(f"model.gated_ffn = {str(m.gated_ffn).lower()}: {m.arch}'s feed-forward is "
                          f"always {form}; set it to {str(arch.gated).lower()}")
    if m.rope_scaling != "none":
        if not arch.rope:
            raise ConfigError(f"model.rope_scaling = '{m.rope_scaling}': {m.arch} has no RoPE; set it to 'none'")
        if m.rope_scaling_factor <= 0:
            raise ConfigError(f"model.rope_scaling_factor = {m.rope_scaling_factor} must be positive")
        if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
            raise ConfigError(f"llama3 RoPE scaling needs 0 < model.rope_low_freq_factor < "
                              f"model.rope_high_freq_factor (now {m.rope_low_freq_factor} and "
                              f"{m.rope_high_freq_factor})")
    if m.head == "value" and arch.kind != "decoder":
        raise ConfigError(f"model.head = 'value' (a reward model or critic) needs a decoder (llama, gpt2, "
                          f"internlm2); {m.arch} is an {arch.kind}")
    if m.head == "value" and m.tie_embeddings:
        raise ConfigError("model.head = 'value' has its own (1, dim) head: set model.tie_embeddings = false")
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout = {m.dropout} must be in [0, 1)")
    if m.rope_original_max_len < 0:
        raise ConfigError(f"model.rope_original_max_len = {m.rope_original_max_len} must be >= 0")
    if arch.kind != "encoder-decoder":
        for key, value, unset in (("n_decoder_layers", m.n_decoder_layers, 0),
                                  ("output_scale", m.output_scale, False)):
            if value != unset:
                raise ConfigError(f"model.{key} = {value} applies to encoder-decoder models (t5), "
                                  f"not {m.arch}; leave it at {unset}")
    elif m.n_decoder_layers < 0:
        raise ConfigError(f"model.n_decoder_layers = {m.n_decoder_layers} must be >= 0")
    if m.type_vocab_size < 1:
        raise ConfigError(f"model.type_vocab_size = {m.type_vocab_size} must be positive")
    if m.rel_pos_buckets < 4 or m.rel_pos_max_distance <= m.rel_pos_buckets // 2:
        raise ConfigError(f"t5 relative positions need model.rel_pos_buckets >= 4 (now {m.rel_pos_buckets}) "
                          f"and model.rel_pos_max_distance > buckets / 2 (now {m.rel_pos_max_distance})")
