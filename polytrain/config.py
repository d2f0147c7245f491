"""One typed config tree: dataclass defaults < TOML file < `--section.key value` overrides.

Every field carries a one-line docstring (read back for `polytrain train --help`).
Mistakes fail at start-up with one line that names the key and the fix:

    >>> load_config(None, ["--train.lrr", "1e-3"])
    ConfigError: unknown key 'train.lrr'; did you mean 'train.lr'?
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError

__all__ = ["Config", "ConfigError", "load_config", "to_toml", "help_text"]


def _choices(*values: str) -> Any:
    return field(default=values[0], metadata={"choices": values})


@dataclass
class RunConfig:
    name: str = "default"
    """Run name; the run directory is runs/<name> unless out_dir is set."""
    out_dir: str = ""
    """Run directory (config.toml, metrics.jsonl, loss.png, checkpoints/); empty = runs/<name>."""
    seed: int = 1234
    """Seed for weights, data order and sampling; the same seed gives the same run."""
    steps: int = 200
    """Number of optimizer steps to train."""
    log_every: int = 10
    """Steps between metrics.jsonl rows and progress-bar updates."""
    eval_every: int = 50
    """Steps between validation-loss measurements (0 = only at the end)."""
    eval_batches: int = 4
    """Global batches of held-out sequences in one validation pass (the same for every layout)."""
    sample_tokens: int = 64
    """Tokens generated from a prompt at the end of training (0 = no sample)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to <run dir>/tensorboard."""
    hang_timeout_s: float = 0.0
    """Seconds a step may take before the watchdog dumps every rank's stacks and last collectives to
    <run dir>/hang/ and ends the attempt; 0 = 10x the slowest step so far (at least 60 s; 900 s for the first); < 0 = off."""


@dataclass
class ModelConfig:
    arch: str = "llama"
    """Model architecture; see polytrain.models.ARCHITECTURES."""
    size: str = "tiny"
    """Size preset of the architecture (llama: tiny ~3M, small ~16M, 125m, 350m, 1b, 7b; custom = none)."""
    dim: int = 0
    """Hidden size (0 = from the size preset)."""
    n_layers: int = 0
    """Number of transformer blocks (0 = from the size preset)."""
    n_heads: int = 0
    """Attention query heads (0 = from the size preset)."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; divides n_heads (0 = from the size preset, else n_heads)."""
    ffn_dim: int = 0
    """SwiGLU hidden size (0 = from the size preset)."""
    vocab_size: int = 0
    """Vocabulary size; the BPE tokenizer is trained to this size (0 = from the size preset)."""
    max_seq_len: int = 0
    """Longest sequence RoPE tables are built for (0 = data.seq_len)."""
    head_dim: int = 0
    """Size of one attention head (0 = dim / n_heads; T5 and some Llamas use another)."""
    n_decoder_layers: int = 0
    """t5: decoder blocks (n_layers counts the encoder's; 0 = as many as the encoder)."""
    activation: str = _choices("silu", "gelu", "gelu_tanh", "relu")
    """Feed-forward nonlinearity: silu, gelu (erf), gelu_tanh (GPT-2's and T5's tanh approximation), relu."""
    gated_ffn: bool = True
    """Gated feed-forward w2(act(w1 x) * w3 x) (SwiGLU, T5 v1.1); false = w2(act(w1 x)) (GPT-2, BERT, T5 v1.0)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: str = _choices("none", "linear", "dynamic", "llama3")
    """RoPE context extension: linear (positions / factor), dynamic (NTK, past the original length), llama3."""
    rope_scaling_factor: float = 1.0
    """RoPE scaling factor (e.g. 8 for Llama-3.1, 2 for InternLM2's dynamic NTK)."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original_len / this are divided by the factor in full."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original_len / this are kept; between the two, interpolated."""
    rope_original_max_len: int = 0
    """Context length the RoPE model was pre-trained at, for llama3 and dynamic scaling (0 = max_seq_len)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms (RMSNorm; LayerNorm for gpt2 and bert; T5's RMS-style LayerNorm)."""
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""
    dropout: float = 0.0
    """Dropout probability in training on attention weights, the embedding, attention and MLP outputs (0 = off)."""
    output_scale: bool = False
    """t5: multiply the decoder's final states by dim ** -0.5 before the output projection (T5 v1.0)."""
    type_vocab_size: int = 2
    """bert: token-type (segment) embeddings."""
    rel_pos_buckets: int = 32
    """t5: relative-position buckets of the attention bias (half per direction in the encoder)."""
    rel_pos_max_distance: int = 128
    """t5: distance from which relative positions share the last, logarithmic bucket."""


@dataclass
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (the .py sources of the running Python) or a path: .txt, .jsonl (field text), prepared .bin."""
    tokenizer: str = "bpe"
    """'bpe' (byte-level BPE trained on the corpus and cached) or a path to a tokenizer.json."""
    seq_len: int = 256
    """Tokens per training sequence."""
    val_fraction: float = 0.02
    """Share of documents held out for validation (chosen by a hash of the document name)."""
    mask_fraction: float = 0.15
    """mlm: share of each sequence's tokens scored (80% [MASK], 10% random, 10% kept); span: share cut out."""
    mean_span_length: float = 3.0
    """span (T5): mean length of the cut-out spans, each replaced by one sentinel."""


@dataclass
class TrainConfig:
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all ranks; a multiple of micro_batch_size x dp."""
    batch_rampup_start: int = 0
    """Batch-size ramp-up (Megatron's --rampup-batch-size): the first global batch; 0 = no ramp-up."""
    batch_rampup_increment: int = 0
    """Ramp-up: sequences the global batch grows by at each increment, up to global_batch_size."""
    batch_rampup_samples: int = 0
    """Ramp-up: samples over which the global batch grows from batch_rampup_start to global_batch_size."""
    lr: float = 3e-3
    """Peak learning rate, reached after warmup_steps."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms, biases or embeddings' gains)."""
    beta1: float = 0.9
    """AdamW and LAMB first-moment decay."""
    beta2: float = 0.95
    """AdamW and LAMB second-moment decay."""
    eps: float = 1e-8
    """AdamW and LAMB epsilon."""
    momentum: float = 0.9
    """SGD and LARS momentum."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all ranks and shards) to this; 0 = no clipping."""
    optimizer: str = _choices("adamw", "lamb", "lars", "sgd")
    """Optimizer: adamw, lamb or lars (per-tensor trust ratios for large batches), or sgd."""
    trust_clip: float = 0.0
    """lamb/lars only: upper bound on each tensor's trust ratio ||w|| / ||update|| (0 = unbounded)."""
    precision: str = _choices("fp32", "bf16", "fp16")
    """Compute precision; bf16/fp16 autocast matmuls while weights and optimizer stay fp32."""
    loss_scale: float = 0.0
    """fp16 only: 0 = dynamic loss scaling; > 0 = this fixed scale."""
    initial_scale_power: int = 16
    """fp16 only: dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16 only: steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """fp16 only: overflows tolerated (each skips its step) before the scale is halved."""
    min_loss_scale: float = 1.0
    """fp16 only: the dynamic scale never goes below this."""
    lr_schedule: str = _choices("cosine", "ds_warmup", "ds_warmup_decay", "ds_warmup_cosine")
    """cosine = linear warmup then cosine to min_lr; ds_* = DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR."""
    warmup_type: str = _choices("linear", "log")
    """ds_* schedules: shape of the warmup (cosine always warms up linearly)."""
    warmup_start_lr: float = 0.0
    """ds_* schedules: learning rate at the start of the warmup."""
    schedule_steps: int = 0
    """ds_warmup_decay / ds_warmup_cosine: step where the decay ends (0 = run.steps)."""
    objective: str = _choices("auto", "causal", "mlm", "span")
    """Pre-training objective: causal (decoders), mlm (bert), span corruption (t5); auto = the architecture's."""
    activation_checkpoint: str = _choices("none", "full", "selective")
    """Recompute activations in backward to save memory: full = each block, selective = the attention core."""
    chunked_loss: bool = True
    """Output projection + cross-entropy a chunk of tokens at a time, never holding (tokens, vocab) logits
    (without tp and pp; tp's vocabulary-parallel loss splits the logits already); false = the plain path."""


@dataclass
class ParallelConfig:
    nproc: int = 1
    """Local worker processes to start (through torch's elastic launcher); 1 = this process; MIN:MAX = elastic."""
    nproc_min: int = 0
    """Elastic: fewest workers the job goes on with (set by --parallel.nproc MIN:MAX); 0 = not elastic."""
    elastic: bool = False
    """Re-derive the layout and micro-batch for whatever world an elastic agent starts, keeping the global
    batch (set by --parallel.nproc MIN:MAX; under torchrun --nnodes MIN:MAX set it yourself)."""
    max_restarts: int = 3
    """Elastic: restarts the local launcher may make (a worker lost or added, a hang)."""
    dp: int = -1
    """Data-parallel degree; -1 = whatever the world size leaves."""
    zero: int = field(default=0, metadata={"choices": (0, 1, 2, 3)})
    """0 = replicate everything; 1 = shard optimizer state; 2 = also gradients; 3 = also parameters (FSDP2)."""
    zero_shard: int = -1
    """Ranks one ZeRO-3 shard group spans; -1 = all of dp; a smaller divisor replicates shards across groups (HSDP)."""
    reduce_bucket_mb: float = 25.0
    """ZeRO-1/2: MiB of gradients reduce-scattered together; smaller buckets start during backward sooner."""
    offload: str = _choices("none", "cpu", "nvme")
    """ZeRO-1/2 masters and optimizer state: on the accelerator (none), in host memory (cpu) or in files (nvme)."""
    nvme_path: str = ""
    """Directory of offload = nvme's memory-mapped state files; empty = <run dir>/offload (a temp dir if unknown)."""
    tp: int = 1
    """Tensor-parallel degree: each layer's weights are split over this many consecutive ranks."""
    tp_mode: str = _choices("1d", "2d", "2.5d", "3d")
    """Tensor-parallel scheme: 1d = Megatron's column/row split; 2d, 2.5d, 3d = Colossal-AI's grids."""
    tp_depth: int = 1
    """2.5d only: depth d of the q x q x d grid (tp = q * q * d)."""
    sp: bool = False
    """Megatron sequence parallelism (needs tp > 1): norms and residuals split along the sequence."""
    pp: int = 1
    """Pipeline-parallel degree: the layers are split into this many stages on different ranks."""
    pp_schedule: str = _choices("1f1b", "gpipe", "interleaved", "zero_bubble")
    """Pipeline schedule; interleaved and zero_bubble run pp_virtual_stages stages per rank."""
    pp_microbatches: int = 0
    """Micro-batches per pipeline run; 0 = all of this rank's micro-batches of the step in one run."""
    pp_virtual_stages: int = 2
    """interleaved / zero_bubble: model chunks (virtual stages) each pipeline rank holds."""
    pp_split: str = ""
    """Module names that start stages 2.. (e.g. "layers.2,layers.4"); empty = balanced by layer count."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Steps between checkpoints (0 = only at the end of training)."""
    keep: int = 2
    """Newest complete checkpoints to keep (0 = keep all)."""
    resume: str = "auto"
    """'auto' = newest complete checkpoint (or snapshot) of this run, 'none' = start fresh, or a checkpoint path."""
    snapshot_every: int = 0
    """Steps between snapshots into host memory (/dev/shm) that a restart resumes from when newer than the
    newest checkpoint (an elastic job loses less work); 0 = none."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir or f"runs/{self.run.name}")


SECTIONS: dict[str, type] = {f.name: type(getattr(Config(), f.name)) for f in fields(Config)}


def field_docs(section_cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass."""
    tree = ast.parse(inspect.getsource(section_cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[stmt.target.id] = nxt.value.value  # type: ignore[attr-defined]
    return docs


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls)]


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; see `polytrain train --help` for all keys"
    return ConfigError(f"unknown key '{key}'{hint}")


def _coerce(key: str, value: Any, want: type, from_text: bool) -> Any:
    """Turn a TOML value or command-line string into the field's type, or fail naming the key."""
    if from_text:
        if want is bool:
            if value in ("true", "false"):
                return value == "true"
        elif want is int:
            try:
                return int(value)
            except ValueError:
                pass
        elif want is float:
            try:
                return float(value)
            except ValueError:
                pass
        else:
            return value
    else:
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if type(value) is want:
            return value
    example = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[want]
    raise ConfigError(f"{key} = {value!r} is not {example}")


def _set(cfg: Config, key: str, value: Any, from_text: bool) -> None:
    if key == "parallel.nproc" and isinstance(value, str) and ":" in value:
        _set_elastic_range(cfg, value)
        return
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name:
        raise _unknown(key)
    section_obj = getattr(cfg, section)
    by_name = {f.name: f for f in fields(section_obj)}
    if name not in by_name:
        raise _unknown(key)
    f = by_name[name]
    want = type(f.default) if f.default is not dataclasses.MISSING else str
    value = _coerce(key, value, want, from_text)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(map(repr, choices))}")
    setattr(section_obj, name, value)


def _set_elastic_range(cfg: Config, value: str) -> None:
    """parallel.nproc = "MIN:MAX": an elastic job of MAX local workers that goes on with MIN."""
    low, _, high = value.partition(":")
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise ConfigError(f"parallel.nproc = {value!r}: write MIN:MAX with 1 <= MIN <= MAX, e.g. 2:4")
    cfg.parallel.nproc, cfg.parallel.nproc_min, cfg.parallel.elastic = int(high), int(low), True


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """['--train.lr', '1e-3', '--run.name=x'] -> [('train.lr', '1e-3'), ('run.name', 'x')]."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key VALUE")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key} needs a value")
            value = args[i + 1]
            i += 2
        pairs.append((key.replace("-", "_"), value))
    return pairs


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, the architecture's defaults, the TOML file at `path`, then `overrides`; then validated.

    The architecture's defaults (e.g. gpt2's GELU and tied embeddings) sit between the
    dataclass defaults and the user's values, so the file and the command line win.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    pairs = parse_overrides(overrides or [])
    cfg = _apply(Config(), data, pairs)
    defaults = _arch_defaults(cfg.model.arch)
    if defaults:  # again, now on top of the architecture's defaults
        cfg = _apply(Config(model=ModelConfig(**{**dataclasses.asdict(ModelConfig()), **defaults})),
                     data, pairs)
    resolve_model(cfg)
    validate(cfg)
    return cfg


def _apply(cfg: Config, data: dict[str, Any], pairs: list[tuple[str, str]]) -> Config:
    for section, values in data.items():
        if not isinstance(values, dict):
            raise _unknown(section)
        for name, value in values.items():
            _set(cfg, f"{section}.{name}", value, from_text=False)
    for key, value in pairs:
        _set(cfg, key, value, from_text=True)
    return cfg


def _arch_defaults(arch: str) -> dict[str, Any]:
    from polytrain.models import ARCHITECTURES

    return dict(ARCHITECTURES[arch].defaults) if arch in ARCHITECTURES else {}


def model_config(arch: str, **fields_: Any) -> ModelConfig:
    """A ModelConfig of `arch` with its architecture defaults, then `fields_` (unresolved, unvalidated)."""
    return ModelConfig(**{**dataclasses.asdict(ModelConfig()), **_arch_defaults(arch), "arch": arch, **fields_})


def resolve_model(cfg: Config) -> None:
    """Fill model fields left at 0 from the architecture's size preset."""
    from polytrain.models import ARCHITECTURES

    m = cfg.model
    if m.arch not in ARCHITECTURES:
        close = difflib.get_close_matches(m.arch, ARCHITECTURES, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"model.arch = '{m.arch}' is not a known architecture "
            f"(known: {', '.join(ARCHITECTURES)}){hint}"
        )
    presets = ARCHITECTURES[m.arch].presets
    if m.size == "custom":  # every field given (e.g. a converted model); validate() finds any left at 0
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


def validate(cfg: Config) -> None:
    """Checks that need no world size; ParallelDims checks the rest when the world is known."""
    m, t, r = cfg.model, cfg.train, cfg.run
    positive = {
        "run.steps": r.steps, "run.log_every": r.log_every, "data.seq_len": cfg.data.seq_len,
        "train.micro_batch_size": t.micro_batch_size, "train.global_batch_size": t.global_batch_size,
        "parallel.nproc": cfg.parallel.nproc, "model.dim": m.dim, "model.n_layers": m.n_layers,
        "model.n_heads": m.n_heads, "model.n_kv_heads": m.n_kv_heads, "model.vocab_size": m.vocab_size,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} = {value} must be positive")
    _validate_model(m)
    from polytrain.data.objectives import objective_name

    objective_name(cfg)  # the objective must fit the architecture
    if cfg.data.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len = {cfg.data.seq_len} exceeds model.max_seq_len = {m.max_seq_len}")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size = {t.micro_batch_size}; try {_nearest_multiple(t.global_batch_size, t.micro_batch_size)}"
        )
    from polytrain.data.batch_schedule import BatchSchedule

    BatchSchedule.from_config(t).validate(t.micro_batch_size)
    if not 0 < cfg.data.mask_fraction < 1 or cfg.data.mean_span_length < 1:
        raise ConfigError(f"data.mask_fraction = {cfg.data.mask_fraction} must be in (0, 1) and "
                          f"data.mean_span_length = {cfg.data.mean_span_length} at least 1")
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction = {cfg.data.val_fraction} must be in (0, 1): validation needs data")
    if t.lr_schedule == "cosine" and t.warmup_type != "linear":
        raise ConfigError("train.warmup_type = 'log' needs a ds_* train.lr_schedule; cosine warms up linearly")
    if t.precision == "fp16" and (t.initial_scale_power < 0 or t.loss_scale < 0 or t.hysteresis < 1
                                  or t.loss_scale_window < 1 or t.min_loss_scale <= 0):
        raise ConfigError("fp16 loss scaling needs loss_scale >= 0, initial_scale_power >= 0, "
                          "hysteresis >= 1, loss_scale_window >= 1 and min_loss_scale > 0")
    _validate_optimizer(t)
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr} is above train.lr = {t.lr}")
    if cfg.parallel.reduce_bucket_mb <= 0:
        raise ConfigError(f"parallel.reduce_bucket_mb = {cfg.parallel.reduce_bucket_mb} must be positive")
    if cfg.parallel.offload != "none" and cfg.parallel.zero not in (1, 2):
        raise ConfigError(
            f"parallel.offload = '{cfg.parallel.offload}' needs parallel.zero = 1 or 2, not {cfg.parallel.zero} "
            f"(it moves ZeRO-1/2's sharded optimizer state); set parallel.zero = 2 or parallel.offload = 'none'"
        )
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 0 or cfg.checkpoint.snapshot_every < 0:
        raise ConfigError("checkpoint.every, checkpoint.keep and checkpoint.snapshot_every must be >= 0")
    if cfg.parallel.nproc_min > cfg.parallel.nproc or cfg.parallel.max_restarts < 0:
        raise ConfigError(f"parallel.nproc_min = {cfg.parallel.nproc_min} must be at most parallel.nproc = "
                          f"{cfg.parallel.nproc}, and parallel.max_restarts >= 0")


def _validate_model(m: ModelConfig) -> None:
    """Head geometry, and the fields that only some architectures have."""
    from polytrain.models import ARCHITECTURES

    arch = ARCHITECTURES[m.arch]
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


def _validate_optimizer(t: TrainConfig) -> None:
    """The keys the chosen optimizer reads must hold values it can step with."""
    if t.optimizer in ("adamw", "lamb"):
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(t, key) < 1:
                raise ConfigError(f"train.{key} = {getattr(t, key)} must be in [0, 1) for {t.optimizer}")
        if t.eps <= 0:
            raise ConfigError(f"train.eps = {t.eps} must be positive for {t.optimizer}")
    if t.optimizer in ("sgd", "lars") and not 0 <= t.momentum < 1:
        raise ConfigError(f"train.momentum = {t.momentum} must be in [0, 1) for {t.optimizer}")
    if t.trust_clip < 0:
        raise ConfigError(f"train.trust_clip = {t.trust_clip} must be >= 0 (0 = unbounded trust ratio)")
    if t.trust_clip > 0 and t.optimizer not in ("lamb", "lars"):
        raise ConfigError(f"train.trust_clip bounds LAMB/LARS trust ratios; train.optimizer = "
                          f"'{t.optimizer}' has none: set train.optimizer = 'lamb' or 'lars', or trust_clip = 0")
    if t.weight_decay < 0:
        raise ConfigError(f"train.weight_decay = {t.weight_decay} must be >= 0")


def _nearest_multiple(value: int, unit: int) -> int:
    return max(unit, round(value / unit) * unit)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that `load_config` reads back to an equal Config."""
    lines = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            text = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    """All keys with their defaults and docstrings, for `polytrain train --help`."""
    out = []
    for section, cls in SECTIONS.items():
        out.append(f"[{section}]")
        docs = field_docs(cls)
        for f in fields(cls):
            default = getattr(cls(), f.name)
            out.append(f"  --{section}.{f.name} {default!r:<10} {docs.get(f.name, '')}")
    return "\n".join(out)
