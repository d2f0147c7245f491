"""Read a DeepSpeed ds_config.json by DeepSpeed's rules and map it onto polytrain's config.

    >>> ds = load_ds_config("ds_config.json", world_size=8)
    >>> load_config(None, to_overrides(ds) + user_overrides)

Every key of the file ends in exactly one of four places:

- mapped onto a polytrain setting (batch sizes, optimizer, scheduler, fp16/bf16, ZeRO
  stage and offload, gradient_clipping, steps_per_print, seed, tensorboard.enabled, the
  `wandb` block's enabled, project and team (run.loggers, run.wandb_project/entity), the
  `elasticity` block: elasticity.py);
- accepted quietly because its value asks for nothing polytrain does not already do
  (`"wall_clock_breakdown": false`, any block with `"enabled": false`);
- a ConfigError, when a key polytrain reads has a value it cannot honour
  (`"type": "OneBitAdam"`, `"amsgrad": true`, fp16 and bf16 both enabled);
- everything else (profilers, monitors, tuning knobs of DeepSpeed's own kernels and
  collectives) is listed, sorted, in one `DeepSpeedConfigWarning` and kept in
  `DSConfig.unsupported`.

Where the file leaves a value out, DeepSpeed's default applies, not polytrain's: no
`gradient_clipping` means no clipping, an Adam block without `weight_decay` means 0,
an optimizer without a scheduler means a constant learning rate.

Known difference: DeepSpeed decays every parameter the user hands it; polytrain never
decays vectors (norm gains, biases).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from polytrain.deepspeed.elasticity import ElasticBatch, elastic_batch
from polytrain.errors import ConfigError
from polytrain.optim.warmup_schedules import Schedule, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "DSConfig",
    "DeepSpeedConfigWarning",
    "LossScaling",
    "OptimizerSpec",
    "load_ds_config",
    "to_overrides",
]

_REQUIRED = object()
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# Keys whose listed values polytrain already honours: telemetry that is off, permissions
# polytrain never withholds, gradient pre-scaling that does not change the mean.
_INERT: dict[str, tuple[Any, ...]] = {
    "wall_clock_breakdown": (False,),
    "memory_breakdown": (False,),
    "dump_state": (False,),
    "sparse_gradients": (False,),
    "prescale_gradients": (False, True),
    "gradient_predivide_factor": (1.0,),
    "zero_allow_untested_optimizer": (False, True),
}


class DeepSpeedConfigWarning(UserWarning):
    """ds_config keys polytrain does not support and ignores, all listed in one warning."""


@dataclass(frozen=True)
class OptimizerSpec:
    """The `optimizer` block as polytrain runs it."""

    type: str
    """The type as the file writes it, e.g. "Adam"."""
    name: str
    """polytrain's train.optimizer: "adamw" or "sgd"."""
    lr: float
    weight_decay: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    """SGD only."""


@dataclass(frozen=True)
class LossScaling:
    """fp16 loss scaling with DeepSpeed's names: loss_scale 0 = dynamic from 2**initial_scale_power,
    halved after `hysteresis` overflowing steps, doubled after loss_scale_window clean ones."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class DSConfig:
    """A ds_config.json resolved by DeepSpeed's rules for one data-parallel world size."""

    world_size: int
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    optimizer: OptimizerSpec | None
    """None: the file has no optimizer block (DeepSpeed would use the client's)."""
    scheduler: Schedule | None
    precision: str
    """"fp32", "bf16" or "fp16"."""
    fp16: LossScaling | None
    """Loss scaling; set exactly when precision is fp16."""
    zero_stage: int
    offload_optimizer: str
    """"none", "cpu" or "nvme"."""
    offload_param: str
    nvme_path: str | None
    reduce_bucket_size: int | None
    """Elements per gradient-reduction bucket, as DeepSpeed counts them; None = not set."""
    gradient_clipping: float
    steps_per_print: int | None
    seed: int | None
    """Not a DeepSpeed key (DeepSpeed ignores it), but ds_configs carry it and it means the seed."""
    tensorboard: bool
    unsupported: tuple[str, ...]
    """Dotted paths of the keys polytrain ignores, sorted."""
    elastic_micro_batch: int | None = None
    """With an enabled `elasticity` block: its largest micro-batch, the ceiling polytrain re-derives
    each world size's micro-batch under (polytrain/plan/elastic.py); None = not elastic."""
    wandb_project: str | None = None
    """With an enabled `wandb` block: its project (DeepSpeed's default "deepspeed"); None = no W&B."""
    wandb_team: str | None = None
    """The `wandb` block's team (W&B entity); None = the user's default."""


def _show(value: Any) -> str:
    """A value as the JSON file writes it: true, "cpu", 5e-05."""
    return json.dumps(value)


class _Reader:
    """The parsed file plus the dotted paths read from it, so the unread ones can be listed."""

    def __init__(self, data: dict[str, Any]):
        self.data = data
        self.read: set[str] = set()

    def has(self, path: str) -> bool:
        return self._node(path) is not _REQUIRED

    def _node(self, path: str) -> Any:
        node, walked = self.data, []
        for part in path.split("."):
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(walked)} = {_show(node)} must be a JSON object")
            if part not in node:
                return _REQUIRED
            node = node[part]
            walked.append(part)
        return node

    def get(self, path: str, default: Any) -> Any:
        """The value at `path`, marked read; `default` when absent (ConfigError if _REQUIRED)."""
        value = self._node(path)
        if value is _REQUIRED:
            if default is _REQUIRED:
                raise ConfigError(f"{path} is required")
            return default
        self.read.add(path)
        return value

    def integer(self, path: str, default: Any, lo: int = 0, hi: int | None = None) -> Any:
        value = self.get(path, default)
        if value is None:
            return None
        # JSON writers emit 5e8 for bucket sizes; an integral float is an integer.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} = {_show(value)} is not an integer")
        if value < lo or (hi is not None and value > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise ConfigError(f"{path} = {value} must be {bound}")
        return value

    def number(self, path: str, default: Any, lo: float = 0.0) -> Any:
        value = self.get(path, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} = {_show(value)} is not a number")
        if value < lo:
            raise ConfigError(f"{path} = {value} must be at least {lo}")
        return float(value)

    def flag(self, path: str, default: bool) -> bool:
        value = self.get(path, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{path} = {_show(value)} is not true or false")
        return value

    def text(self, path: str, default: Any, choices: tuple[str, ...] = ()) -> Any:
        value = self.get(path, default)
        if not isinstance(value, str):
            raise ConfigError(f"{path} = {_show(value)} is not a string")
        if choices and value not in choices:
            raise ConfigError(
                f"{path} = {_show(value)} is not one of {', '.join(map(_show, choices))}"
            )
        return value

    def fixed(self, path: str, honoured: Any) -> None:
        """A key polytrain reads but honours only at DeepSpeed's default value."""
        value = self.get(path, honoured)
        if value != honoured or isinstance(value, bool) != isinstance(honoured, bool):
            raise ConfigError(
                f"{path} = {_show(value)} is not supported; "
                f"polytrain runs {path.rsplit('.', 1)[1]} = {_show(honoured)}"
            )

    def unread(self) -> list[str]:
        """Paths never read, sorted; a block none of whose keys was read is listed whole."""
        for path, accepted in _INERT.items():
            value = self._node(path)
            if any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted):
                self.read.add(path)

        def covered(path: str) -> bool:
            return any(path == r or path.startswith(r + ".") for r in self.read)

        def touched(path: str) -> bool:
            return any(r.startswith(path + ".") for r in self.read)

        def walk(node: dict[str, Any], prefix: str):
            for key, value in node.items():
                path = prefix + key
                if covered(path) or (isinstance(value, dict) and value.get("enabled") is False):
                    continue  # read, or a disabled block, which asks for nothing
                if isinstance(value, dict) and touched(path):
                    yield from walk(value, path + ".")
                else:
                    yield path

        return sorted(walk(self.data, ""))


def _read_json(source: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"DeepSpeed config {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"a DeepSpeed config is a JSON object, not {type(data).__name__}")
    return data


def _reject_auto(data: dict[str, Any]) -> None:
    """Refuse "auto", a placeholder Hugging Face's Trainer fills in before DeepSpeed reads it."""

    def autos(node: dict[str, Any], prefix: str):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from autos(value, f"{prefix}{key}.")
            elif value == "auto":
                yield prefix + key

    found = sorted(autos(data, ""))
    if found:
        raise ConfigError(
            f'{", ".join(found)} = "auto": Hugging Face Trainer fills these in; '
            "write the values into the file"
        )


def _nearby(value: int, unit: int) -> str:
    below, above = max(unit, value // unit * unit), -(-value // unit) * unit
    return str(above) if below == above else f"{below} or {above}"


def _batch(r: _Reader, world: int) -> tuple[int, int, int]:
    """(train_batch_size, micro, gas) by DeepSpeed's rules.

    Any two (with the world size) fix the third; train_batch_size alone or micro alone means
    gas = 1; gas alone is an error. DeepSpeed floors the divisions and then asserts the product,
    so a batch that does not divide fails there too; here the message gives the valid values.
    """
    tb = r.integer("train_batch_size", None, lo=1)
    mb = r.integer("train_micro_batch_size_per_gpu", None, lo=1)
    gas = r.integer("gradient_accumulation_steps", None, lo=1)
    if tb is None and mb is None:
        raise ConfigError(
            "the DeepSpeed config sets neither train_batch_size nor "
            "train_micro_batch_size_per_gpu; "
            "set one (gradient_accumulation_steps alone does not fix the batch)"
        )
    if tb is None:
        gas = gas or 1
        return mb * gas * world, mb, gas
    if mb is not None and gas is not None:
        if tb != mb * gas * world:
            raise ConfigError(
                f"train_batch_size = {tb} != train_micro_batch_size_per_gpu x "
                "gradient_accumulation_steps "
                f"x world_size = {mb} x {gas} x {world} = {mb * gas * world}; "
                f"set train_batch_size to {mb * gas * world} or leave one of the three out"
            )
        return tb, mb, gas
    if mb is not None:
        unit, label = mb * world, f"train_micro_batch_size_per_gpu x world_size = {mb} x {world}"
    elif gas is not None:
        unit, label = gas * world, f"gradient_accumulation_steps x world_size = {gas} x {world}"
    else:
        gas, unit, label = 1, world, "world_size"
    if tb % unit:
        raise ConfigError(
            f"train_batch_size = {tb} is not a multiple of {label} = {unit}; "
            f"set train_batch_size to {_nearby(tb, unit)}"
        )
    if mb is None:
        return tb, tb // unit, gas
    return tb, mb, tb // unit


def _elasticity(r: _Reader, world: int) -> ElasticBatch | None:
    """The `elasticity` block by DeepSpeed's version-0.1 rule (polytrain/deepspeed/elasticity.py), or None."""
    if not r.flag("elasticity.enabled", False):
        return None
    version = r.number("elasticity.version", 0.1)
    if version != 0.1:
        raise ConfigError(f"elasticity.version = {_show(version)}: polytrain implements version 0.1 "
                          f"(a global batch from the micro-batch sizes); set it to 0.1")
    micro = r.get("elasticity.micro_batch_sizes", [2, 4, 6])
    if not isinstance(micro, list) or not all(isinstance(m, int) and not isinstance(m, bool) for m in micro):
        raise ConfigError(f"elasticity.micro_batch_sizes = {_show(micro)} must be a list of integers")
    r.get("elasticity.min_time", 0)  # a hint for schedulers: nothing to run
    batch = elastic_batch(micro, r.integer("elasticity.max_train_batch_size", 2000, lo=1),
                          r.integer("elasticity.min_gpus", 1, lo=1), r.integer("elasticity.max_gpus", None, lo=1),
                          r.flag("elasticity.prefer_larger_batch", True))
    given = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
             if r.has(k)]
    if given and not r.flag("elasticity.ignore_non_elastic_batch_info", False):
        raise ConfigError(f"{', '.join(given)} conflict with the enabled elasticity block, which chooses the batch "
                          f"({batch.global_batch_size}); remove them or set "
                          f"elasticity.ignore_non_elastic_batch_info = true")
    for key in given:
        r.get(key, None)  # ignored, as DeepSpeed ignores them then
    return batch


def _precision(r: _Reader) -> tuple[str, LossScaling | None]:
    fp16 = r.flag("fp16.enabled", False)
    bf16_key = "bf16" if "bf16" in r.data else "bfloat16"  # DeepSpeed still reads the old name
    bf16 = r.flag(f"{bf16_key}.enabled", False)
    if fp16 and bf16:
        raise ConfigError(
            f"fp16.enabled and {bf16_key}.enabled are both true; "
            "a run has one precision: set one to false"
        )
    if bf16:
        return "bf16", None
    if not fp16:
        return "fp32", None
    r.fixed("fp16.consecutive_hysteresis", False)
    r.fixed("fp16.fp16_master_weights_and_grads", False)
    return "fp16", LossScaling(
        loss_scale=r.number("fp16.loss_scale", 0.0),
        initial_scale_power=r.integer("fp16.initial_scale_power", 16),
        loss_scale_window=r.integer("fp16.loss_scale_window", 1000, lo=1),
        hysteresis=r.integer("fp16.hysteresis", 2, lo=1),
        min_loss_scale=r.number("fp16.min_loss_scale", 1.0),
    )


def _optimizer(r: _Reader) -> OptimizerSpec | None:
    if not r.has("optimizer"):
        return None
    kind = r.text("optimizer.type", _REQUIRED)
    key, p = kind.lower(), "optimizer.params"
    if key == "lamb":
        raise ConfigError(
            f'optimizer.type = "{kind}" is not mapped (DeepSpeed\'s Lamb also bounds trust ratios '
            "from below by min_coeff; polytrain's does not); use Adam, AdamW or SGD here, or "
            "drop the optimizer block and pass --train.optimizer lamb"
        )
    if key not in ("adam", "adamw", "sgd"):
        raise ConfigError(f'optimizer.type = "{kind}" is not supported; use Adam, AdamW or SGD')
    if r.has(f"{p}.max_grad_norm"):
        raise ConfigError(
            f"{p}.max_grad_norm is not an optimizer parameter in DeepSpeed; use gradient_clipping"
        )
    lr = r.number(f"{p}.lr", 1e-3)  # the default of DeepSpeed's Adam and of torch's SGD
    if key == "sgd":
        r.fixed(f"{p}.nesterov", False)
        r.fixed(f"{p}.dampening", 0)
        weight_decay = r.number(f"{p}.weight_decay", 0.0)
        return OptimizerSpec(kind, "sgd", lr, weight_decay, momentum=r.number(f"{p}.momentum", 0.0))
    torch_adam = r.flag(f"{p}.torch_adam", False)
    decoupled = r.flag(f"{p}.adam_w_mode", True) or key == "adamw"  # DeepSpeed's "Adam" is AdamW
    # torch.optim.AdamW (torch_adam) defaults weight_decay to 0.01, DeepSpeed's own Adams to 0.
    weight_decay = r.number(f"{p}.weight_decay", 0.01 if torch_adam and decoupled else 0.0)
    if not decoupled and weight_decay:
        raise ConfigError(
            f'optimizer "{kind}" with adam_w_mode false adds weight_decay = {weight_decay} '
            "to the gradient (L2), which polytrain's AdamW does not do; "
            "set adam_w_mode to true or weight_decay to 0"
        )
    r.fixed(f"{p}.amsgrad", False)
    r.fixed(f"{p}.bias_correction", True)
    betas = r.get(f"{p}.betas", [0.9, 0.999])
    if (
        not isinstance(betas, list)
        or len(betas) != 2
        or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
        )
    ):
        raise ConfigError(f"{p}.betas = {_show(betas)} must be two numbers in [0, 1)")
    eps = r.number(f"{p}.eps", 1e-8)
    return OptimizerSpec(
        kind, "adamw", lr, weight_decay, betas=(float(betas[0]), float(betas[1])), eps=eps
    )


def _scheduler(r: _Reader, optimizer: OptimizerSpec | None) -> Schedule | None:
    if not r.has("scheduler"):
        return None
    kind, p = r.text("scheduler.type", _REQUIRED), "scheduler.params"
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        raise ConfigError(
            f'scheduler.type = "{kind}" is not supported; '
            "polytrain reads WarmupLR, WarmupDecayLR and WarmupCosineLR"
        )
    r.fixed(f"{p}.last_batch_iteration", -1)
    warmup = {
        "warmup_num_steps": r.integer(f"{p}.warmup_num_steps", 1000, lo=1),
        # DeepSpeed falls back to "log" on an unknown type with a warning; polytrain refuses.
        "warmup_type": r.text(f"{p}.warmup_type", "log", ("log", "linear")),
    }
    opt_lr = optimizer.lr if optimizer else _REQUIRED
    if kind == "WarmupCosineLR":
        if optimizer is None:
            raise ConfigError(
                "scheduler WarmupCosineLR scales the optimizer's lr; "
                "add an optimizer block with params.lr"
            )
        return WarmupCosineLR(
            lr=opt_lr,
            total_num_steps=r.integer(f"{p}.total_num_steps", _REQUIRED, lo=1),
            warmup_min_ratio=r.number(f"{p}.warmup_min_ratio", 0.0),
            cos_min_ratio=r.number(f"{p}.cos_min_ratio", 1e-4),
            **warmup,
        )
    min_lr = r.number(f"{p}.warmup_min_lr", 0.0)
    if kind == "WarmupLR":
        # DeepSpeed's WarmupLR peaks at the optimizer's lr unless warmup_max_lr is given.
        return WarmupLR(
            warmup_min_lr=min_lr, warmup_max_lr=r.number(f"{p}.warmup_max_lr", opt_lr), **warmup
        )
    return WarmupDecayLR(
        warmup_min_lr=min_lr,
        warmup_max_lr=r.number(f"{p}.warmup_max_lr", 1e-3),
        total_num_steps=r.integer(f"{p}.total_num_steps", _REQUIRED, lo=1),
        **warmup,
    )


def _zero(r: _Reader) -> tuple[int, str, str, str | None, int | None]:
    z = "zero_optimization"
    stage = r.integer(f"{z}.stage", 0, hi=3)
    opt_dev = r.text(f"{z}.offload_optimizer.device", "none", _OFFLOAD_DEVICES)
    param_dev = r.text(f"{z}.offload_param.device", "none", _OFFLOAD_DEVICES)
    if param_dev != "none" and stage != 3:
        raise ConfigError(f"{z}.offload_param needs ZeRO stage 3, not {stage}; set {z}.stage to 3")
    if opt_dev == "nvme" and stage != 3:
        raise ConfigError(
            f'{z}.offload_optimizer.device = "nvme" needs ZeRO stage 3, not {stage}; '
            f"set {z}.stage to 3"
        )
    if opt_dev != "none" and stage == 0:
        raise ConfigError(f"{z}.offload_optimizer needs ZeRO stage 1, 2 or 3; set {z}.stage")
    paths = {
        r.text(f"{z}.{block}.nvme_path", _REQUIRED)
        for block, device in (("offload_optimizer", opt_dev), ("offload_param", param_dev))
        if device == "nvme"
    }
    if len(paths) > 1:
        raise ConfigError(
            f"{z}.offload_optimizer.nvme_path and {z}.offload_param.nvme_path differ; "
            "polytrain swaps both to one directory: make them equal"
        )
    # polytrain's own limits, checked after DeepSpeed's rules so the message fits the file.
    if "none" not in (opt_dev, param_dev) and opt_dev != param_dev:
        raise ConfigError(f'{z}.offload_param.device = "{param_dev}" and {z}.offload_optimizer.device = '
                          f'"{opt_dev}" differ: polytrain\'s ZeRO-3 keeps its fp32 parameter shards, which are '
                          f"the optimizer's master weights, in one place; give both the same device")
    bucket = r.integer(f"{z}.reduce_bucket_size", None, lo=1)
    return stage, opt_dev, param_dev, paths.pop() if paths else None, bucket


def _wandb(r: _Reader) -> dict[str, str | None]:
    """The `wandb` block's project and team, when enabled (its `group` is not read: W&B runs of polytrain
    are not grouped)."""
    if not r.flag("wandb.enabled", False):
        return {}
    team = r.text("wandb.team", "") or None
    return {"wandb_project": r.text("wandb.project", "deepspeed"), "wandb_team": team}


def load_ds_config(source: dict[str, Any] | str | Path, *, world_size: int) -> DSConfig:
    """Read a ds_config (a dict or a JSON file) for `world_size` data-parallel ranks.

    Raises ConfigError (one line naming the key and the fix) for a missing or invalid file
    or a value polytrain cannot honour; warns once, listing every key it ignores.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size = {world_size!r} must be a positive integer")
    data = _read_json(source)
    _reject_auto(data)
    r = _Reader(data)
    elastic = _elasticity(r, world_size)
    if elastic is None:
        train_batch, micro, gas = _batch(r, world_size)
    else:  # DeepSpeed's elastic batch; the plain batch keys stay unread unless told to ignore them
        train_batch, micro = elastic.global_batch_size, elastic.micro_batch_at(world_size)
        gas = train_batch // (micro * world_size)
    precision, fp16 = _precision(r)
    optimizer = _optimizer(r)
    scheduler = _scheduler(r, optimizer)
    stage, offload_optimizer, offload_param, nvme_path, bucket = _zero(r)
    wandb = _wandb(r)  # read before r.unread() lists what is left
    ds = DSConfig(
        world_size=world_size,
        train_batch_size=train_batch,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        optimizer=optimizer,
        scheduler=scheduler,
        precision=precision,
        fp16=fp16,
        zero_stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        nvme_path=nvme_path,
        reduce_bucket_size=bucket,
        gradient_clipping=r.number("gradient_clipping", 0.0),  # DeepSpeed's default: no clipping
        steps_per_print=r.integer("steps_per_print", None, lo=1),
        seed=r.integer("seed", None),
        tensorboard=r.flag("tensorboard.enabled", False),
        unsupported=tuple(r.unread()),
        elastic_micro_batch=max(elastic.micro_batch_sizes) if elastic else None,
        **wandb,
    )
    if ds.unsupported:
        warnings.warn(
            f"polytrain ignores these DeepSpeed config keys: {', '.join(ds.unsupported)}",
            DeepSpeedConfigWarning,
            stacklevel=2,
        )
    return ds


def _text(value: Any) -> str:
    """A value as a command-line override: true/false, shortest exact float, plain int or string."""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)


def to_overrides(ds: DSConfig) -> list[str]:
    """polytrain `--section.key value` overrides that reproduce `ds`, for `load_config`."""
    out: dict[str, Any] = {
        "train.micro_batch_size": ds.train_micro_batch_size_per_gpu,
        "train.global_batch_size": ds.train_batch_size,
        "train.grad_clip": ds.gradient_clipping,
        "train.precision": ds.precision,
    }
    if ds.fp16:
        out |= {f"train.{name}": value for name, value in asdict(ds.fp16).items()}
    opt = ds.optimizer
    if opt:
        out |= {
            "train.optimizer": opt.name,
            "train.lr": opt.lr,
            "train.weight_decay": opt.weight_decay,
        }
        if opt.name == "adamw":
            out |= {"train.beta1": opt.betas[0], "train.beta2": opt.betas[1], "train.eps": opt.eps}
        else:
            out["train.momentum"] = opt.momentum
    if ds.scheduler:
        out |= ds.scheduler.to_train()
    elif opt:
        # DeepSpeed without a scheduler keeps the optimizer's lr: a cosine from lr to lr, no warmup.
        out |= {"train.lr_schedule": "cosine", "train.warmup_steps": 0, "train.min_lr": opt.lr}
    out |= {"parallel.zero": ds.zero_stage, "parallel.offload": ds.offload_optimizer,
            "parallel.offload_params": ds.offload_param}
    if ds.nvme_path:
        out["parallel.nvme_path"] = ds.nvme_path
    if ds.reduce_bucket_size:
        # DeepSpeed counts elements of the gradient dtype (2 bytes in fp16/bf16); keep the bytes.
        element = 4 if ds.precision == "fp32" else 2
        out["parallel.reduce_bucket_mb"] = ds.reduce_bucket_size * element / 2**20
    if ds.steps_per_print:
        out["run.log_every"] = ds.steps_per_print
    if ds.seed is not None:
        out["run.seed"] = ds.seed
    loggers = [name for name, on in (("tensorboard", ds.tensorboard), ("wandb", ds.wandb_project)) if on]
    if loggers:
        out["run.loggers"] = ",".join(loggers)
    if ds.wandb_project:
        out["run.wandb_project"] = ds.wandb_project
    if ds.wandb_team:
        out["run.wandb_entity"] = ds.wandb_team
    if ds.elastic_micro_batch:
        out |= {"parallel.elastic": True, "train.micro_batch_size": ds.elastic_micro_batch}
    return [token for key, value in out.items() for token in (f"--{key}", _text(value))]
