"""DeepSpeed ds_config.json: DeepSpeed's rules, exact one-line errors, one warning, overrides."""

from __future__ import annotations

import json
import math
import re
import warnings
from types import SimpleNamespace

import pytest

from polytrain.config import load_config
from polytrain.config.schema import all_keys
from polytrain.deepspeed import (
    DeepSpeedConfigWarning,
    LossScaling,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    load_ds_config,
    schedule_from_train,
    to_overrides,
)
from polytrain.errors import ConfigError

# Keys to_overrides emits that polytrain's config does not have yet (the lead adds them).
NEW_KEYS = {
    "train.eps",
    "train.momentum",
    "train.lr_schedule",
    "train.warmup_type",
    "train.warmup_start_lr",
    "train.schedule_steps",
    "train.loss_scale",
    "train.initial_scale_power",
    "train.loss_scale_window",
    "train.hysteresis",
    "train.min_loss_scale",
    "parallel.offload",
    "parallel.nvme_path",
    "parallel.reduce_bucket_mb",
}


def load(cfg: dict, world_size: int = 1):
    """load_ds_config failing on any warning, so each test states the warnings it expects."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_ds_config(cfg, world_size=world_size)


def fails(cfg: dict, message: str, world_size: int = 1) -> None:
    with pytest.raises(ConfigError) as e:
        load_ds_config(cfg, world_size=world_size)
    assert str(e.value) == message


def pairs(overrides: list[str]) -> dict[str, str]:
    assert len(overrides) % 2 == 0 and all(k.startswith("--") for k in overrides[::2])
    return {k[2:]: v for k, v in zip(overrides[::2], overrides[1::2])}


# -- reading -----------------------------------------------------------------------------


def test_reads_a_json_file_and_reports_bad_files_in_one_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    assert load_ds_config(path, world_size=1).train_batch_size == 2
    assert load_ds_config(str(path), world_size=1).train_batch_size == 2
    with pytest.raises(ConfigError, match=r"^DeepSpeed config .*nope.json does not exist$"):
        load_ds_config(tmp_path / "nope.json", world_size=1)
    path.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError) as e:
        load_ds_config(path, world_size=1)
    # The decoder's wording varies between Python versions; the position does not leave the line.
    assert str(e.value).startswith(f"{path} is not valid JSON: ") and ": line 1 column 2" in str(
        e.value
    )
    path.write_text("[1]")
    with pytest.raises(ConfigError, match=r"^a DeepSpeed config is a JSON object, not list$"):
        load_ds_config(path, world_size=1)
    with pytest.raises(ConfigError, match=r"^world_size = 0 must be a positive integer$"):
        load_ds_config({}, world_size=0)


def test_hugging_face_auto_placeholders_are_refused():
    fails(
        {
            "train_batch_size": "auto",
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
        },
        'train_batch_size, zero_optimization.reduce_bucket_size = "auto": Hugging Face Trainer '
        "fills these in; write the values into the file",
    )


def test_types_are_checked_with_the_key_named():
    fails({"train_batch_size": "8"}, 'train_batch_size = "8" is not an integer')
    fails({"train_batch_size": 0}, "train_batch_size = 0 must be at least 1")
    fails(
        {"train_batch_size": 8, "zero_optimization": 2},
        "zero_optimization = 2 must be a JSON object",
    )
    fails(
        {"train_batch_size": 8, "zero_optimization": {"stage": 4}},
        "zero_optimization.stage = 4 must be between 0 and 3",
    )
    fails(
        {"train_batch_size": 8, "gradient_clipping": True},
        "gradient_clipping = true is not a number",
    )
    # JSON writers print bucket sizes as 5e8; an integral float is an integer.
    assert (
        load(
            {"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 5e8}}
        ).reduce_bucket_size
        == 500_000_000
    )


# -- batch sizes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, (32, 4, 4)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, (32, 4, 4)),
        (
            {
                "train_batch_size": 32,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 4,
            },
            (32, 4, 4),
        ),
        ({"train_batch_size": 32}, (32, 16, 1)),  # alone: gas = 1, micro = 32 / world
        ({"train_micro_batch_size_per_gpu": 4}, (8, 4, 1)),  # alone: gas = 1
    ],
)
def test_batch_sizes_are_derived_by_deepspeeds_rules(given, expected):
    ds = load(given, world_size=2)
    assert (
        ds.train_batch_size,
        ds.train_micro_batch_size_per_gpu,
        ds.gradient_accumulation_steps,
    ) == expected


def test_batch_size_errors_show_the_arithmetic_and_valid_values():
    fails(
        {"gradient_accumulation_steps": 4},
        "the DeepSpeed config sets neither train_batch_size nor train_micro_batch_size_per_gpu; "
        "set one (gradient_accumulation_steps alone does not fix the batch)",
    )
    fails(
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        },
        "train_batch_size = 32 != train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
        "world_size = 4 x 2 x 2 = 16; set train_batch_size to 16 or leave one of the three out",
        world_size=2,
    )
    fails(
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
        "train_batch_size = 30 is not a multiple of train_micro_batch_size_per_gpu x world_size "
        "= 4 x 2 = 8; set train_batch_size to 24 or 32",
        world_size=2,
    )
    fails(
        {"train_batch_size": 30, "gradient_accumulation_steps": 2},
        "train_batch_size = 30 is not a multiple of gradient_accumulation_steps x world_size "
        "= 2 x 2 = 4; set train_batch_size to 28 or 32",
        world_size=2,
    )
    fails(
        {"train_batch_size": 30},
        "train_batch_size = 30 is not a multiple of world_size = 4; "
        "set train_batch_size to 28 or 32",
        world_size=4,
    )
    fails(
        {"train_batch_size": 3, "train_micro_batch_size_per_gpu": 4},
        "train_batch_size = 3 is not a multiple of train_micro_batch_size_per_gpu x world_size "
        "= 4 x 1 = 4; set train_batch_size to 4",
    )


# -- optimizer ---------------------------------------------------------------------------


def test_deepspeed_adam_is_adamw_with_deepspeeds_defaults():
    ds = load({"train_batch_size": 8, "optimizer": {"type": "Adam"}})
    opt = ds.optimizer
    assert (opt.name, opt.lr, opt.betas, opt.eps, opt.weight_decay) == (
        "adamw",
        1e-3,
        (0.9, 0.999),
        1e-8,
        0.0,
    )
    ds = load(
        {
            "train_batch_size": 8,
            "optimizer": {
                "type": "adamw",
                "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1},
            },
        }
    )
    over = pairs(to_overrides(ds))
    assert [
        over[k]
        for k in (
            "train.optimizer",
            "train.lr",
            "train.beta1",
            "train.beta2",
            "train.eps",
            "train.weight_decay",
        )
    ] == ["adamw", "0.0003", "0.9", "0.95", "1e-06", "0.1"]
    # torch_adam builds torch.optim.AdamW, whose weight_decay defaults to 0.01.
    ds = load(
        {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    )
    assert ds.optimizer.weight_decay == 0.01


def test_adam_without_w_mode_is_honoured_only_without_weight_decay():
    ds = load(
        {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}
    )
    assert ds.optimizer.name == "adamw" and ds.optimizer.weight_decay == 0.0
    fails(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}},
        },
        'optimizer "Adam" with adam_w_mode false adds weight_decay = 0.01 to the gradient (L2), '
        "which polytrain's AdamW does not do; set adam_w_mode to true or weight_decay to 0",
    )


def test_sgd_keeps_deepspeeds_momentum():
    ds = load(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        }
    )
    over = pairs(to_overrides(ds))
    assert (
        over["train.optimizer"],
        over["train.lr"],
        over["train.momentum"],
        over["train.weight_decay"],
    ) == ("sgd", "0.1", "0.9", "0.0")
    assert "train.eps" not in over and "train.beta1" not in over
    assert (
        load({"train_batch_size": 8, "optimizer": {"type": "SGD"}}).optimizer.momentum == 0.0
    )  # torch's default


@pytest.mark.parametrize(
    "optimizer, message",
    [
        (
            {"type": "OneBitAdam"},
            'optimizer.type = "OneBitAdam" is not supported; use Adam, AdamW or SGD',
        ),
        (
            {"type": "Lamb"},
            (
                'optimizer.type = "Lamb" is not mapped (DeepSpeed\'s Lamb also bounds trust '
                "ratios from below by min_coeff; polytrain's does not); use Adam, AdamW or SGD "
                "here, or drop the optimizer block and pass --train.optimizer lamb"
            ),
        ),
        ({"params": {"lr": 1e-3}}, "optimizer.type is required"),
        (
            {"type": "Adam", "params": {"amsgrad": True}},
            "optimizer.params.amsgrad = true is not supported; polytrain runs amsgrad = false",
        ),
        (
            {"type": "SGD", "params": {"nesterov": True}},
            "optimizer.params.nesterov = true is not supported; polytrain runs nesterov = false",
        ),
        (
            {"type": "Adam", "params": {"max_grad_norm": 1.0}},
            (
                "optimizer.params.max_grad_norm is not an optimizer parameter in DeepSpeed; "
                "use gradient_clipping"
            ),
        ),
        (
            {"type": "Adam", "params": {"betas": [0.9]}},
            "optimizer.params.betas = [0.9] must be two numbers in [0, 1)",
        ),
    ],
)
def test_optimizer_values_polytrain_cannot_honour_are_errors(optimizer, message):
    fails({"train_batch_size": 8, "optimizer": optimizer}, message)


# -- schedulers --------------------------------------------------------------------------


def test_warmup_lr_log_and_linear():
    log = WarmupLR(warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10, warmup_type="log")
    assert log.lr_at(0) == pytest.approx(0.1)
    assert log.lr_at(3) == pytest.approx(0.1 + math.log(4) / math.log(10))
    assert log.lr_at(9) == pytest.approx(1.1)
    assert log.lr_at(500) == pytest.approx(1.1)
    linear = WarmupLR(
        warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10, warmup_type="linear"
    )
    assert [linear.lr_at(s) for s in (0, 5, 9, 10, 11)] == pytest.approx([0.1, 0.6, 1.0, 1.1, 1.1])
    # DeepSpeed floors warmup_num_steps at 2 (the log warmup divides by log n).
    one = WarmupLR(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert [one.lr_at(s) for s in (0, 1, 2)] == pytest.approx([0.0, 0.5, 1.0])


def test_warmup_decay_lr_decays_linearly_to_warmup_min_lr_at_total_num_steps():
    s = WarmupDecayLR(
        warmup_min_lr=0.0,
        warmup_max_lr=1.0,
        warmup_num_steps=10,
        warmup_type="linear",
        total_num_steps=110,
    )
    assert [s.lr_at(k) for k in (0, 5, 10, 60, 100, 110, 200)] == pytest.approx(
        [0, 0.5, 1.0, 0.5, 0.1, 0, 0]
    )
    floor = WarmupDecayLR(
        warmup_min_lr=0.1,
        warmup_max_lr=1.1,
        warmup_num_steps=10,
        warmup_type="log",
        total_num_steps=110,
    )
    assert floor.lr_at(60) == pytest.approx(0.6) and floor.lr_at(110) == pytest.approx(0.1)


def test_warmup_cosine_lr_ratios_of_the_optimizer_lr():
    s = WarmupCosineLR(
        lr=2.0,
        total_num_steps=110,
        warmup_min_ratio=0.2,
        warmup_num_steps=10,
        cos_min_ratio=0.1,
        warmup_type="linear",
    )
    assert s.lr_at(0) == pytest.approx(0.4)
    assert s.lr_at(5) == pytest.approx(2.0 * (0.2 + 0.5 * 0.8))
    # The first step after warmup already counts 1 of the 100 decay steps.
    assert s.lr_at(10) == pytest.approx(2.0 * (0.1 + 0.9 * (1 + math.cos(math.pi / 100)) / 2))
    assert s.lr_at(59) == pytest.approx(2.0 * 0.55)
    assert s.lr_at(109) == pytest.approx(0.2) and s.lr_at(500) == pytest.approx(
        0.2
    )  # held at the floor
    log = WarmupCosineLR(
        lr=1.0,
        total_num_steps=110,
        warmup_min_ratio=0.0,
        warmup_num_steps=10,
        cos_min_ratio=1e-4,
        warmup_type="log",
    )
    assert log.lr_at(0) == 0.0 and log.lr_at(3) == pytest.approx(math.log(4) / math.log(10))


def test_scheduler_blocks_fill_deepspeeds_defaults():
    base = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.5}}}
    assert load(base | {"scheduler": {"type": "WarmupLR"}}).scheduler == WarmupLR(
        warmup_min_lr=0.0, warmup_max_lr=0.5, warmup_num_steps=1000, warmup_type="log"
    )  # peak = optimizer lr
    assert load(
        base | {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}}}
    ).scheduler == (
        WarmupDecayLR(
            warmup_min_lr=0.0,
            warmup_max_lr=1e-3,
            warmup_num_steps=1000,
            warmup_type="log",
            total_num_steps=5000,
        )
    )
    assert load(
        base | {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}}}
    ).scheduler == (
        WarmupCosineLR(
            lr=0.5,
            total_num_steps=5000,
            warmup_min_ratio=0.0,
            warmup_num_steps=1000,
            cos_min_ratio=1e-4,
            warmup_type="log",
        )
    )


@pytest.mark.parametrize(
    "scheduler, message",
    [
        (
            {"type": "OneCycle"},
            (
                'scheduler.type = "OneCycle" is not supported; '
                "polytrain reads WarmupLR, WarmupDecayLR and WarmupCosineLR"
            ),
        ),
        ({"type": "WarmupDecayLR"}, "scheduler.params.total_num_steps is required"),
        (
            {"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
            'scheduler.params.warmup_type = "cosine" is not one of "log", "linear"',
        ),
        (
            {"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
            "scheduler.params.warmup_num_steps = 0 must be at least 1",
        ),
        (
            {"type": "WarmupLR", "params": {"last_batch_iteration": 5}},
            (
                "scheduler.params.last_batch_iteration = 5 is not supported; "
                "polytrain runs last_batch_iteration = -1"
            ),
        ),
    ],
)
def test_scheduler_errors(scheduler, message):
    fails({"train_batch_size": 8, "optimizer": {"type": "Adam"}, "scheduler": scheduler}, message)


def test_cosine_without_an_optimizer_block_is_an_error():
    fails(
        {
            "train_batch_size": 8,
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9}},
        },
        "scheduler WarmupCosineLR scales the optimizer's lr; add an optimizer block with params.lr",
    )


@pytest.mark.parametrize(
    "schedule",
    [
        WarmupLR(warmup_min_lr=1e-5, warmup_max_lr=3e-4, warmup_num_steps=7, warmup_type="linear"),
        WarmupDecayLR(
            warmup_min_lr=0.0,
            warmup_max_lr=3e-4,
            warmup_num_steps=7,
            warmup_type="log",
            total_num_steps=40,
        ),
        WarmupCosineLR(
            lr=3e-4,
            total_num_steps=40,
            warmup_min_ratio=0.1,
            warmup_num_steps=7,
            cos_min_ratio=0.05,
            warmup_type="linear",
        ),
    ],
)
def test_schedule_round_trips_through_polytrain_train_keys(schedule):
    train = SimpleNamespace(**{k.split(".")[1]: v for k, v in schedule.to_train().items()})
    train.__dict__.setdefault("schedule_steps", 0)
    rebuilt = schedule_from_train(train, run_steps=40)
    assert type(rebuilt) is type(schedule)
    assert [rebuilt.lr_at(s) for s in range(45)] == pytest.approx(
        [schedule.lr_at(s) for s in range(45)], rel=1e-12
    )
    assert (
        schedule_from_train(SimpleNamespace(**vars(train) | {"lr_schedule": "cosine"}), 40) is None
    )


# -- precision ---------------------------------------------------------------------------


def test_fp16_keeps_deepspeeds_loss_scaler_settings():
    ds = load(
        {
            "train_batch_size": 8,
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 12,
                "loss_scale_window": 500,
                "hysteresis": 3,
                "min_loss_scale": 0.5,
            },
        }
    )
    assert ds.precision == "fp16"
    assert ds.fp16 == LossScaling(
        loss_scale=0.0,
        initial_scale_power=12,
        loss_scale_window=500,
        hysteresis=3,
        min_loss_scale=0.5,
    )
    assert (
        load({"train_batch_size": 8, "fp16": {"enabled": True}}).fp16 == LossScaling()
    )  # DeepSpeed's defaults
    fails(
        {"train_batch_size": 8, "fp16": {"enabled": True, "consecutive_hysteresis": True}},
        (
            "fp16.consecutive_hysteresis = true is not supported; "
            "polytrain runs consecutive_hysteresis = false"
        ),
    )


def test_bf16_fp32_and_the_fp16_bf16_contradiction():
    assert load({"train_batch_size": 8, "bf16": {"enabled": True}}).precision == "bf16"
    assert (
        load({"train_batch_size": 8, "bfloat16": {"enabled": True}}).precision == "bf16"
    )  # the old name
    ds = load(
        {"train_batch_size": 8, "fp16": {"enabled": False, "loss_scale": 0}}
    )  # disabled: asks nothing
    assert (ds.precision, ds.fp16) == ("fp32", None)
    fails(
        {"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "fp16.enabled and bf16.enabled are both true; a run has one precision: set one to false",
    )


# -- ZeRO and offload --------------------------------------------------------------------


def test_zero_stage_and_offload_devices_map():
    ds = load({"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    over = pairs(to_overrides(ds))
    assert (over["parallel.zero"], over["parallel.offload"]) == ("2", "cpu")
    over = pairs(to_overrides(load({"train_batch_size": 8, "zero_optimization": {"stage": 2}})))
    assert (over["parallel.zero"], over["parallel.offload"], over["parallel.offload_params"]) == ("2", "none", "none")
    assert "parallel.nvme_path" not in over


@pytest.mark.parametrize("zero, expected", [
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}, ("nvme", "nvme")),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, ("none", "cpu")),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, ("cpu", "none")),
])
def test_zero3_offload_blocks_map(zero, expected):
    over = pairs(to_overrides(load({"train_batch_size": 8, "zero_optimization": zero})))
    assert (over["parallel.offload"], over["parallel.offload_params"]) == expected
    assert over.get("parallel.nvme_path") == ("/nvme" if "nvme" in expected else None)


def test_zero3_offload_devices_must_agree():
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}
    with pytest.raises(ConfigError, match=re.escape('zero_optimization.offload_param.device = "cpu" and '
                                                    'zero_optimization.offload_optimizer.device = "nvme" differ')):
        load({"train_batch_size": 8, "zero_optimization": zero})


def test_reduce_bucket_size_in_elements_becomes_mebibytes_of_the_gradient_dtype():
    zero = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20}}
    assert (
        pairs(to_overrides(load({"train_batch_size": 8} | zero)))["parallel.reduce_bucket_mb"]
        == "4.0"
    )
    bf16 = {"train_batch_size": 8, "bf16": {"enabled": True}} | zero
    assert pairs(to_overrides(load(bf16)))["parallel.reduce_bucket_mb"] == "2.0"


@pytest.mark.parametrize(
    "zero, message",
    [
        (
            {"stage": 2, "offload_param": {"device": "cpu"}},
            (
                "zero_optimization.offload_param needs ZeRO stage 3, not 2; "
                "set zero_optimization.stage to 3"
            ),
        ),
        (
            {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}},
            (
                'zero_optimization.offload_optimizer.device = "nvme" needs ZeRO stage 3, not 2; '
                "set zero_optimization.stage to 3"
            ),
        ),
        (
            {"stage": 0, "offload_optimizer": {"device": "cpu"}},
            (
                "zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3; "
                "set zero_optimization.stage"
            ),
        ),
        (
            {"stage": 3, "offload_optimizer": {"device": "nvme"}},
            "zero_optimization.offload_optimizer.nvme_path is required",
        ),
        (
            {"stage": 3, "offload_optimizer": {"device": "gpu"}},
            (
                'zero_optimization.offload_optimizer.device = "gpu" '
                'is not one of "none", "cpu", "nvme"'
            ),
        ),
        (
            {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                "offload_param": {"device": "nvme", "nvme_path": "/b"},
            },
            (
                "zero_optimization.offload_optimizer.nvme_path and "
                "zero_optimization.offload_param.nvme_path differ; "
                "polytrain swaps both to one directory: make them equal"
            ),
        ),
    ],
)
def test_offload_errors(zero, message):
    fails({"train_batch_size": 8, "zero_optimization": zero}, message)


# -- keys polytrain ignores --------------------------------------------------------------


def test_unsupported_keys_are_listed_once_sorted_and_nothing_else_warns():
    cfg = {
        "train_batch_size": 8,
        "zero_optimization": {
            "stage": 2,
            "stage3_prefetch_bucket_size": 5e7,
            "overlap_comm": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
        "flops_profiler": {"enabled": True, "profile_step": 1},
        "wall_clock_breakdown": True,
        "amp": {"enabled": False, "opt_level": "O1"},  # disabled: asks for nothing
        "zero_allow_untested_optimizer": True,  # polytrain never withholds this
        "steps_per_print": 5,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_ds_config(cfg, world_size=1)
    assert len(caught) == 1 and caught[0].category is DeepSpeedConfigWarning
    expected = (
        "flops_profiler",
        "wall_clock_breakdown",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.overlap_comm",
        "zero_optimization.stage3_prefetch_bucket_size",
    )
    assert ds.unsupported == expected
    assert (
        str(caught[0].message)
        == f"polytrain ignores these DeepSpeed config keys: {', '.join(expected)}"
    )
    quiet = load(
        {
            "train_batch_size": 8,
            "wall_clock_breakdown": False,
            "tensorboard": {"enabled": False, "output_path": "tb"},
            "optimizer": {"type": "Adam", "params": {"torch_adam": False}},
        }
    )
    assert quiet.unsupported == ()


# -- overrides ---------------------------------------------------------------------------


FULL = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 20,
    "seed": 7,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-4,
            "warmup_num_steps": 100,
            "total_num_steps": 1000,
        },
    },
    "fp16": {"enabled": True, "loss_scale_window": 500},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "reduce_bucket_size": 5e8,
    },
    "tensorboard": {"enabled": True},
}


def test_overrides_reproduce_the_whole_config():
    ds = load(FULL, world_size=4)
    assert ds.gradient_accumulation_steps == 4
    assert to_overrides(ds) == [
        "--train.micro_batch_size",
        "4",
        "--train.global_batch_size",
        "64",
        "--train.grad_clip",
        "1.0",
        "--train.precision",
        "fp16",
        "--train.loss_scale",
        "0.0",
        "--train.initial_scale_power",
        "16",
        "--train.loss_scale_window",
        "500",
        "--train.hysteresis",
        "2",
        "--train.min_loss_scale",
        "1.0",
        "--train.optimizer",
        "adamw",
        "--train.lr",
        "0.0003",
        "--train.weight_decay",
        "0.1",
        "--train.beta1",
        "0.9",
        "--train.beta2",
        "0.95",
        "--train.eps",
        "1e-08",
        "--train.lr_schedule",
        "ds_warmup_decay",
        "--train.warmup_start_lr",
        "0.0",
        "--train.min_lr",
        "0.0",
        "--train.warmup_steps",
        "100",
        "--train.warmup_type",
        "log",
        "--train.schedule_steps",
        "1000",
        "--parallel.zero",
        "2",
        "--parallel.offload",
        "cpu",
        "--parallel.offload_params",
        "none",
        "--parallel.reduce_bucket_mb",
        "953.67431640625",
        "--run.log_every",
        "20",
        "--run.seed",
        "7",
        "--run.loggers",
        "tensorboard",
    ]


def test_deepspeed_defaults_win_over_polytrains_where_the_file_is_silent():
    over = pairs(
        to_overrides(
            load({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
        )
    )
    assert over["train.grad_clip"] == "0.0"  # DeepSpeed clips only when gradient_clipping is set
    assert over["train.weight_decay"] == "0.0"
    # No scheduler block: DeepSpeed keeps the optimizer's lr, i.e. a flat cosine without warmup.
    assert (over["train.lr_schedule"], over["train.warmup_steps"], over["train.min_lr"]) == (
        "cosine",
        "0",
        "0.01",
    )
    assert "run.log_every" not in over and "run.seed" not in over


def test_emitted_keys_are_polytrain_keys_or_the_announced_new_ones():
    ds = load(FULL, world_size=4)
    sgd = load(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "SGD"},
            "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        }
    )
    emitted = set(pairs(to_overrides(ds))) | set(pairs(to_overrides(sgd)))
    assert emitted - set(all_keys()) <= NEW_KEYS
    # The keys polytrain has today load, with the values they name.
    existing = [
        t
        for k, v in pairs(to_overrides(ds)).items()
        if k in all_keys() and k != "train.precision"
        for t in (f"--{k}", v)
    ]
    cfg = load_config(None, existing)
    assert (
        cfg.train.micro_batch_size,
        cfg.train.global_batch_size,
        cfg.train.lr,
        cfg.train.beta2,
    ) == (4, 64, 3e-4, 0.95)
    assert (cfg.run.log_every, cfg.run.seed, cfg.run.loggers, cfg.train.warmup_steps) == (
        20,
        7,
        "tensorboard",
        100,
    )


def test_wandb_block_turns_on_the_wandb_logger_with_its_project_and_team():
    base = {"train_batch_size": 8, "tensorboard": {"enabled": True}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_ds_config(base | {"wandb": {"enabled": True, "team": "lab", "project": "llm", "group": "g1"}},
                            world_size=1)
    over = pairs(to_overrides(ds))
    assert (over["run.loggers"], over["run.wandb_project"], over["run.wandb_entity"]) == ("tensorboard,wandb", "llm", "lab")
    assert "wandb.group" in str(caught[0].message)  # read by nothing, so named
    cfg = load_config(None, to_overrides(ds))
    assert (cfg.run.loggers, cfg.run.wandb_project, cfg.run.wandb_entity) == ("tensorboard,wandb", "llm", "lab")
    # DeepSpeed's default project; a disabled block turns nothing on and is not warned about.
    assert pairs(to_overrides(load({"train_batch_size": 8, "wandb": {"enabled": True}})))["run.wandb_project"] == "deepspeed"
    off = load({"train_batch_size": 8, "wandb": {"enabled": False, "project": "x"}})
    assert "run.loggers" not in pairs(to_overrides(off)) and off.unsupported == ()
