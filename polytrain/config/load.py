"""Loading the config tree: dataclass defaults < TOML file < `--section.key value` overrides.

Mistakes fail at start-up with one line that names the key and the fix:

    >>> load_config(None, ["--train.lrr", "1e-3"])
    ConfigError: unknown key 'train.lrr'; did you mean 'train.lr'?

The loader records which keys the file and the overrides set (`Config.set_keys`), then asks
the model registry to fill in what the architecture decides (its defaults for keys nobody
set, the size preset) and to check the model fields; that one look-up is the only thing
here that knows models exist.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import tomllib

from polytrain.config.schema import SECTIONS, Config, DataConfig, RLHFConfig, TrainConfig, all_keys, field_docs
from polytrain.errors import ConfigError


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
        if want is str and isinstance(value, bool):  # a switch with more settings than on/off
            return "true" if value else "false"     # (train.attention_fp32 = true): the choices check it
        if type(value) is want:
            return value
    example = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[want]
    raise ConfigError(f"{key} = {value!r} is not {example}")


def _sources_text(key: str, tables: list) -> str:
    """A TOML list of {path, weight} tables as the "PATH:W,..." text the field holds (written back so)."""
    parts = []
    for entry in tables:
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ConfigError(f"{key}: each entry is a table {{path = \"...\", weight = W}}, not {entry!r}")
        parts.append(f"{entry['path']}:{entry.get('weight', 1.0)}")
    return ",".join(parts)


def set_value(cfg: Config, key: str, value: Any, from_text: bool) -> None:
    """Set `section.key` on `cfg` from a TOML value or (`from_text`) a command-line string."""
    if key == "parallel.nproc" and isinstance(value, str) and ":" in value:
        _set_elastic_range(cfg, value)
        return
    if key == "run.tensorboard":  # the key before run.loggers: true adds tensorboard to it
        if _coerce(key, value, bool, from_text):
            cfg.run.loggers = ",".join(dict.fromkeys([*_names(cfg.run.loggers), "tensorboard"]))
        return
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name:
        raise _unknown(key)
    section_obj = getattr(cfg, section)
    by_name = {f.name: f for f in fields(section_obj)}
    if name not in by_name:
        raise _unknown(key)
    f = by_name[name]
    if f.metadata.get("sources") and isinstance(value, list) and not from_text:
        value = _sources_text(key, value)
    if f.metadata.get("names") and isinstance(value, list) and not from_text:
        if not all(isinstance(name, str) for name in value):
            raise ConfigError(f"{key} = {value!r}: list names as strings, e.g. [\"tensorboard\", \"wandb\"]")
        value = ",".join(value)
    want = type(f.default) if f.default is not dataclasses.MISSING else str
    value = _coerce(key, value, want, from_text)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(map(repr, choices))}")
    if f.metadata.get("names"):
        value = _check_names(key, value, f.metadata["names"])
    setattr(section_obj, name, value)


def _names(text: str) -> list[str]:
    """"tensorboard, wandb" -> ["tensorboard", "wandb"] (a list-valued key's text form)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _check_names(key: str, text: str, allowed: tuple[str, ...]) -> str:
    """A list-valued key's comma-separated names, each one of `allowed` and given once; normalised."""
    names = _names(text)
    for name in names:
        if name not in allowed:
            raise ConfigError(f"{key}: {name!r} is not one of {', '.join(allowed)}")
        if names.count(name) > 1:
            raise ConfigError(f"{key} names {name!r} twice; give each once")
    return ",".join(names)


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


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict, or one ConfigError line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text (UTF-8) TOML file") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, the TOML file at `path`, then `overrides`; the architecture's part; validated.

    The architecture's defaults (e.g. gpt2's GELU and tied embeddings) apply to the keys
    the file and the command line leave unset, so the user's values always win.
    """
    data = read_toml(path) if path is not None else {}
    cfg = Config()
    set_keys = []
    for section, values in data.items():
        if not isinstance(values, dict):
            raise _unknown(section)
        for name, value in values.items():
            set_value(cfg, f"{section}.{name}", value, from_text=False)
            set_keys.append(f"{section}.{name}")
    for key, value in parse_overrides(overrides or []):
        set_value(cfg, key, value, from_text=True)
        set_keys.append(key)
    cfg.set_keys = frozenset(set_keys)
    from polytrain.models.registry import (  # the one look-up: see above
        apply_defaults,
        resolve_model,
    )

    apply_defaults(cfg)
    resolve_model(cfg)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks of the values themselves, needing neither the model nor the world size.

    The model registry checks the model fields; the start-up layout check (train/startup.py)
    checks everything that depends on the world size.
    """
    m, t, r = cfg.model, cfg.train, cfg.run
    positive = {
        "run.steps": r.steps, "run.log_every": r.log_every, "data.seq_len": cfg.data.seq_len,
        "train.micro_batch_size": t.micro_batch_size, "train.global_batch_size": t.global_batch_size,
        "parallel.nproc": cfg.parallel.nproc, "run.eval_batches": r.eval_batches,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} = {value} must be positive")
    non_negative = {
        "run.eval_every": (r.eval_every, "0 = only at the end"), "run.sample_tokens": (r.sample_tokens, "0 = no sample"),
        "train.warmup_steps": (t.warmup_steps, "0 = no warmup"), "train.grad_clip": (t.grad_clip, "0 = no clipping"),
        "train.schedule_steps": (t.schedule_steps, "0 = run.steps"), "train.lr": (t.lr, None),
        "train.min_lr": (t.min_lr, None), "train.warmup_start_lr": (t.warmup_start_lr, None),
    }
    for key, (value, zero) in non_negative.items():
        if not value >= 0:  # also catches NaN
            raise ConfigError(f"{key} = {value} must be >= 0" + (f" ({zero})" if zero else ""))
    if cfg.data.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len = {cfg.data.seq_len} exceeds model.max_seq_len = {m.max_seq_len}")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size = {t.micro_batch_size}; try {_nearest_multiple(t.global_batch_size, t.micro_batch_size)}"
        )
    if not 0 < cfg.data.mask_fraction < 1 or cfg.data.mean_span_length < 1:
        raise ConfigError(f"data.mask_fraction = {cfg.data.mask_fraction} must be in (0, 1) and "
                          f"data.mean_span_length = {cfg.data.mean_span_length} at least 1")
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction = {cfg.data.val_fraction} must be in (0, 1): validation needs data")
    if t.lr_schedule == "cosine" and t.warmup_type != "linear":
        raise ConfigError("train.warmup_type = 'log' needs a ds_* train.lr_schedule; cosine warms up linearly")
    if t.autocast_only and t.precision == "fp32":
        raise ConfigError("train.autocast_only applies to train.precision bf16 or fp16; remove it or set "
                          "the precision")
    if t.attention_fp32 == "true" and t.precision == "fp32":
        raise ConfigError("train.attention_fp32 upcasts a 16-bit attention core: set train.precision "
                          "bf16 or fp16, or leave it auto")
    if t.matmul_fp32 == "true" and t.precision == "fp32":
        raise ConfigError("train.matmul_fp32 widens 16-bit products: set train.precision bf16 or fp16, "
                          "or leave it auto")
    if t.attention_fp32 == "true" and (cfg.parallel.cp > 1 or cfg.data.packed_documents):
        raise ConfigError("train.attention_fp32 is not supported with parallel.cp > 1 or "
                          "data.packed_documents (their attention exchanges k and v, which fp32 would double)")
    if t.precision == "fp16" and (t.initial_scale_power < 0 or t.loss_scale < 0 or t.hysteresis < 1
                                  or t.loss_scale_window < 1 or t.min_loss_scale <= 0):
        raise ConfigError("fp16 loss scaling needs loss_scale >= 0, initial_scale_power >= 0, "
                          "hysteresis >= 1, loss_scale_window >= 1 and min_loss_scale > 0")
    _validate_optimizer(t)
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr} is above train.lr = {t.lr}")
    if cfg.parallel.reduce_bucket_mb <= 0:
        raise ConfigError(f"parallel.reduce_bucket_mb = {cfg.parallel.reduce_bucket_mb} must be positive")
    if cfg.parallel.reduce_bucket_auto and cfg.parallel.zero not in (1, 2):
        raise ConfigError(f"parallel.reduce_bucket_auto sizes ZeRO-1/2's gradient buckets; parallel.zero = "
                          f"{cfg.parallel.zero} has none (set parallel.zero 1 or 2, or leave it off)")
    _validate_offload(cfg)
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 0 or cfg.checkpoint.snapshot_every < 0:
        raise ConfigError("checkpoint.every, checkpoint.keep and checkpoint.snapshot_every must be >= 0")
    p = cfg.parallel
    if p.nproc_min > p.nproc or p.max_restarts < 0 or (p.nproc_start and not p.nproc_min <= p.nproc_start <= p.nproc):
        raise ConfigError(f"parallel.nproc_min = {p.nproc_min} <= parallel.nproc_start = {p.nproc_start} <= "
                          f"parallel.nproc = {p.nproc} must hold (nproc_start 0 = nproc), and parallel.max_restarts >= 0")
    if t.compile and cfg.parallel.tp > 1 and t.activation_checkpoint == "selective":
        # torch 2.13's partitioner files the tp mesh among the tensors saved around the
        # recomputed attention core and fails at the first backward.
        raise ConfigError("train.compile = true with parallel.tp > 1 cannot recompute selectively "
                          "(torch.compile fails on it); set train.activation_checkpoint = 'full' or "
                          "train.compile = false")
    if cfg.data.sources and cfg.data.source != DataConfig().source:
        raise ConfigError("data.source and data.sources are both set; data.sources blends several corpora "
                          "in place of data.source: keep one")
    _validate_lora(cfg)
    _validate_rlhf(cfg.rlhf)


def _validate_lora(cfg: Config) -> None:
    """The adapters' own values; which layers the patterns match is checked against the model at start-up."""
    lo = cfg.lora
    if lo.rank < 0:
        raise ConfigError(f"lora.rank = {lo.rank} must be >= 0 (0 = no adapters)")
    if lo.rank == 0:  # off: the other keys are not read (a saved config.toml lists them all)
        return
    if lo.alpha <= 0:
        raise ConfigError(f"lora.alpha = {lo.alpha} must be positive (the adapters scale by alpha / rank)")
    if not 0 <= lo.dropout < 1:
        raise ConfigError(f"lora.dropout = {lo.dropout} must be in [0, 1)")
    patterns = [p.strip() for p in lo.targets.split(",")]
    if not lo.targets.strip() or any(not p or "" in p.split(".") for p in patterns):
        raise ConfigError(f"lora.targets = {lo.targets!r} must be comma-separated module-name patterns "
                          "such as 'layers' or 'wq,wv'")


def _validate_rlhf(r: RLHFConfig) -> None:
    """Ranges of the rlhf keys; the step list, sources and split are checked where `polytrain rlhf` reads them."""
    for key in ("max_prompt_len", "max_new_tokens", "task_pairs", "task_demos", "eval_rows"):
        if getattr(r, key) <= 0:
            raise ConfigError(f"rlhf.{key} = {getattr(r, key)} must be positive")
    for key in ("ppo_epochs", "ppo_mini_batches"):
        if getattr(r, key) < 1:
            raise ConfigError(f"rlhf.{key} = {getattr(r, key)} must be at least 1 (1 = DeepSpeed-Chat's default)")
    for key in ("kl_coef", "reward_clip", "policy_clip", "value_clip", "grpo_kl_coef", "ptx_coef", "temperature"):
        if getattr(r, key) < 0:
            raise ConfigError(f"rlhf.{key} = {getattr(r, key)} must be >= 0")
    for key in ("gamma", "lam", "top_p", "ema_beta"):
        if not 0 <= getattr(r, key) <= 1:
            raise ConfigError(f"rlhf.{key} = {getattr(r, key)} must be in [0, 1]")
    for key in ("sft_steps", "reward_steps", "ppo_steps", "sft_lr", "reward_lr", "actor_lr", "critic_lr",
                "actor_tp", "reference_tp", "reward_tp", "critic_tp"):
        if getattr(r, key) < 0:
            raise ConfigError(f"rlhf.{key} = {getattr(r, key)} must be >= 0 (0 = the default it names)")
    if r.top_k < 0:
        raise ConfigError(f"rlhf.top_k = {r.top_k} must be >= 0 (0 = all tokens)")
    if r.group_size < 2:
        raise ConfigError(f"rlhf.group_size = {r.group_size} must be at least 2 (GRPO compares samples of a prompt)")
    if not 0 <= r.task_noise < 1:
        raise ConfigError(f"rlhf.task_noise = {r.task_noise} must be in [0, 1)")


def _validate_offload(cfg: Config) -> None:
    """parallel.offload / offload_params against the ZeRO stage and the layout."""
    p = cfg.parallel
    if p.offload != "none" and p.zero == 0:
        raise ConfigError(f"parallel.offload = '{p.offload}' moves ZeRO's sharded optimizer state; set "
                          f"parallel.zero to 1, 2 or 3, or parallel.offload = 'none'")
    if p.offload_params != "none" and p.zero != 3:
        raise ConfigError(f"parallel.offload_params = '{p.offload_params}' needs parallel.zero = 3 (sharded "
                          f"parameters), not {p.zero}; set parallel.zero = 3 or use parallel.offload")
    if p.zero != 3 or (p.offload, p.offload_params) == ("none", "none"):
        return
    if "none" not in (p.offload, p.offload_params) and p.offload != p.offload_params:
        raise ConfigError(f"parallel.offload = '{p.offload}' and parallel.offload_params = '{p.offload_params}': "
                          f"ZeRO-3's fp32 parameter shards are its optimizer's masters, so they live in one "
                          f"place; give both the same value, or set one to 'none'")
    for key, wrong in (("parallel.tp", p.tp != 1), ("parallel.pp", p.pp != 1)):
        if wrong:
            raise ConfigError(f"ZeRO-3 offload runs over data parallelism only; set {key} = 1 or "
                              f"parallel.offload and parallel.offload_params to 'none'")
    if "nvme" in (p.offload, p.offload_params) and cfg.train.precision == "fp16":
        raise ConfigError("train.precision = fp16 with ZeRO-3 nvme offload: fp16 loss scaling unscales the "
                          "gradients in memory, and these live in files; use train.precision = bf16")


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
    """The sections as plain dicts ({"run": {...}, "model": {...}, ...})."""
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


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
