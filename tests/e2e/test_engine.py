"""`polytrain.initialize`: a DeepSpeed-style script trains exactly as polytrain's Trainer does."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import polytrain
from polytrain.engine import EngineUsageError
from polytrain.errors import CheckpointError, ConfigError
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import train_rows
from tests.multirank import run_ranks

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "deepspeed_style" / "train.py"
RTOL = 1e-5
STEPS = 6
# The Trainer's tiny config (tests/conftest.py) as a ds_config, with a warmup that does not start at 0.
DS_CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3,
                                                  "warmup_num_steps": 3, "warmup_type": "linear"}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "steps_per_print": 3,
}


def _script():
    spec = importlib.util.spec_from_file_location("deepspeed_style_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script_args(corpus: Path, config: Path, *extra: str) -> list[str]:
    """The script on the data, model and seed of `tiny_overrides`."""
    return ["--deepspeed_config", str(config), "--data", str(corpus), "--seq_len", "64",
            "--val_fraction", "0.1", "--seed", "7", "--steps", str(STEPS), *extra]


def assert_same_rows(ref: list[dict], got: list[dict], what: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref], what
    for a, b in zip(ref, got):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=RTOL), f"{what}: {key} at step {a['step']}"
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-12), f"{what}: lr at step {a['step']}"


# ----- a small model for the API tests ------------------------------------------------------------


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _mlp_data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)


def _mlp_config(**extra) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_num_steps": 4}},
            "gradient_clipping": 1.0, "steps_per_print": 1000, **extra}


def _mlp_train(engine, steps: int, first_step: int = 0) -> list[float]:
    """Train `steps` steps on the fixed data; each rank reads its slice of each global batch."""
    x, y = _mlp_data()
    tb, micro = engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()
    per_rank = tb // engine.world_size
    losses = []
    for step in range(first_step, first_step + steps):
        start = (step * tb) % len(x) + engine.global_rank * per_rank
        total = 0.0
        for i in range(start, start + per_rank, micro):
            loss = ((engine(x[i:i + micro]) - y[i:i + micro]) ** 2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.item() / engine.gradient_accumulation_steps()
        losses.append(total)
    mean = torch.tensor(losses, dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(mean)
        mean /= torch.distributed.get_world_size()
    return mean.tolist()


# ----- the script matches the Trainer ----------------------------------------------------------------


@pytest.fixture(scope="module")
def ds_config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ds") / "ds_config.json"
    path.write_text(json.dumps(DS_CONFIG))
    return path


@pytest.fixture(scope="module")
def trainer_run(small_corpus, tmp_path_factory) -> Path:
    """polytrain's Trainer on the same ds_config (its settings override the tiny config's)."""
    from polytrain.config import load_config
    from polytrain.deepspeed import load_ds_config, to_overrides
    from polytrain.train.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("trainer")
    ds = load_ds_config(DS_CONFIG, world_size=1)
    overrides = tiny_overrides(small_corpus, run_dir, run__steps=STEPS) + to_overrides(ds)
    Trainer(load_config(None, overrides + ["--run.log_every", "1"])).train()
    return run_dir


@pytest.mark.slow
def test_script_matches_trainer_on_one_process(small_corpus, ds_config_file, trainer_run, capsys):
    rows = _script().main(_script_args(small_corpus, ds_config_file))
    assert_same_rows(train_rows(trainer_run), rows, "engine, 1 process")
    out = capsys.readouterr().out
    assert "step 3 | loss" in out and "step 6 | loss" in out  # steps_per_print = 3
    assert rows[-1]["loss"] < rows[0]["loss"]


def _two_ranks(rank: int, world_size: int, corpus: Path, config: Path, save_dir: Path) -> dict:
    rows = _script().main(_script_args(corpus, config, "--save_dir", str(save_dir)))
    # A model without `.layers` under ZeRO-3 is sharded as one FSDP unit.
    engine, *_ = polytrain.initialize(model=_mlp(), config=_mlp_config(
        zero_optimization={"stage": 3}))
    zero3 = _mlp_train(engine, 3)
    sizes = {}
    for name, cfg in {"tb+micro": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2},
                      "micro+gas": {"train_micro_batch_size_per_gpu": 2,
                                    "gradient_accumulation_steps": 3}}.items():
        e, *_ = polytrain.initialize(model=_mlp(), config=cfg)
        sizes[name] = (e.train_batch_size(), e.train_micro_batch_size_per_gpu(),
                       e.gradient_accumulation_steps(), e.world_size)
    return {"rows": rows, "zero3": zero3, "sizes": sizes}


@pytest.mark.slow
def test_script_matches_trainer_on_two_ranks_with_zero2(small_corpus, ds_config_file, trainer_run,
                                                          tmp_path):
    save_dir = tmp_path / "ckpt"
    results = run_ranks(2, _two_ranks, small_corpus, ds_config_file, save_dir)
    assert_same_rows(train_rows(trainer_run), results[0]["rows"], "engine, 2 ranks ZeRO-2")
    # DeepSpeed's batch rules at 2 ranks: 8 = 2 x gas x 2 -> gas 2; 2 x 3 x 2 -> 12.
    assert results[0]["sizes"] == {"tb+micro": (8, 2, 2, 2), "micro+gas": (12, 2, 3, 2)}

    # ZeRO-3 over 2 ranks takes the single process's steps.
    engine, *_ = polytrain.initialize(model=_mlp(), config=_mlp_config())
    assert results[0]["zero3"] == pytest.approx(_mlp_train(engine, 3), rel=RTOL)

    # The 2-rank ZeRO-2 checkpoint loads in one process and holds the Trainer's final weights.
    from polytrain.checkpoint.trainer_state import latest_checkpoint, load_model_weights
    from polytrain.config import ModelConfig
    from polytrain.models.llama.model import Llama

    script = _script()
    assert (save_dir / "latest").read_text() == f"global_step{STEPS}"
    model = script.LlamaLM(ModelConfig(**script.MODEL, max_seq_len=64))
    engine, *_ = polytrain.initialize(model=model, config=str(ds_config_file))
    path, client_state = engine.load_checkpoint(save_dir)
    assert Path(path) == save_dir / f"global_step{STEPS}" and engine.global_steps == STEPS
    assert client_state["sampler"]["consumed"] == STEPS * 8
    reference = Llama(ModelConfig(**script.MODEL, max_seq_len=64))
    load_model_weights(latest_checkpoint(trainer_run), reference)
    # atol: 2 ranks sum gradients in another order than one process, and AdamW turns that fp32
    # rounding into up to ~1e-5 on weights whose gradients are near 0 (the host activation kernels'
    # rounding moved one element of 8,192 to 2.4e-6); a weight the checkpoint missed is off by what
    # six steps at lr <= 3e-3 move it (~1e-3 to 1e-2), a misplaced one by a whole weight.
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(engine.module.state_dict()[name], want, rtol=RTOL, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_fp16_skipped_steps_hold_the_schedule_in_script_and_trainer_alike(small_corpus, tmp_path):
    """As DeepSpeed: an overflowing step is counted (global_steps) but steps neither the optimizer
    nor the lr scheduler, in the engine and in the Trainer on the same ds_config."""
    from polytrain.config import load_config
    from polytrain.deepspeed import load_ds_config, to_overrides
    from polytrain.train.trainer import Trainer

    config = {**DS_CONFIG, "fp16": {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    overrides = tiny_overrides(small_corpus, tmp_path / "trainer", run__steps=STEPS) + to_overrides(
        load_ds_config(config, world_size=1))
    # The script's model computes F.cross_entropy on full logits: the Trainer's plain loss.
    # The engine autocasts the user's fp32 model (it keeps fp32 weights), which is the Trainer's
    # train.autocast_only mode; the Trainer's default fp16 keeps 16-bit weights and overflows elsewhere.
    # The engine runs the user's model as it is: its attention core and products autocast to fp16 too.
    Trainer(load_config(None, overrides + ["--run.log_every", "1", "--train.chunked_loss", "false",
                                           "--train.autocast_only", "true",
                                           "--train.attention_fp32", "false", "--train.matmul_fp32", "false"])).train()
    want, got = train_rows(tmp_path / "trainer"), _script().main(_script_args(small_corpus, path))
    assert 0 < sum(r["grad_norm"] is None for r in want) < STEPS
    assert [r["grad_norm"] is None for r in got] == [r["grad_norm"] is None for r in want]
    assert_same_rows([{**r, "grad_norm": r["grad_norm"] or 0.0} for r in want],
                     [{**r, "grad_norm": r["grad_norm"] or 0.0} for r in got], "engine vs Trainer, fp16")


@pytest.mark.slow
def test_script_runs_under_torchrun(small_corpus, ds_config_file, tmp_path):
    env = {**os.environ, "POLYTRAIN_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(SCRIPT), *_script_args(small_corpus, ds_config_file)[:-1], "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 2 steps on 2 rank(s)" in done.stdout


# ----- gradient accumulation ------------------------------------------------------------------------


def test_optimizer_steps_only_at_accumulation_boundaries():
    model = _mlp()
    engine, optimizer, loader, scheduler = polytrain.initialize(
        model=model, model_parameters=model.parameters(), config=_mlp_config())
    assert loader is None and optimizer is engine.optimizer and scheduler is engine.lr_scheduler
    assert engine.gradient_accumulation_steps() == 4
    x, y = _mlp_data()
    before = [p.detach().clone() for p in engine.module.parameters()]
    boundaries = []
    for i in range(8):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(((engine(x[2 * i:2 * i + 2]) - y[2 * i:2 * i + 2]) ** 2).mean())
        engine.step()
        changed = any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
        assert changed == (i >= 3), f"weights after micro-step {i}"
        assert engine.global_steps == (i + 1) // 4
    assert boundaries == [False, False, False, True] * 2
    assert scheduler.steps == 2 and engine.micro_steps == 8


def test_accumulation_equals_one_big_micro_batch():
    """4 micro-batches of 2 take the same step as 1 micro-batch of 8."""
    big, *_ = polytrain.initialize(model=_mlp(), config={
        **_mlp_config(), "train_micro_batch_size_per_gpu": 8})
    small, *_ = polytrain.initialize(model=_mlp(), config=_mlp_config())
    assert big.gradient_accumulation_steps() == 1
    assert _mlp_train(big, 2) == pytest.approx(_mlp_train(small, 2), rel=1e-6)
    for a, b in zip(big.module.parameters(), small.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert big.get_global_grad_norm() == pytest.approx(small.get_global_grad_norm(), rel=1e-6)


def test_calls_out_of_order_fail_with_one_line():
    engine, *_ = polytrain.initialize(model=_mlp(), config=_mlp_config())
    with pytest.raises(EngineUsageError, match="before engine.backward"):
        engine.step()
    with torch.no_grad():
        loss = engine(torch.zeros(2, 8)).sum()
    with pytest.raises(EngineUsageError, match="no gradient"):
        engine.backward(loss)


# ----- schedule, client optimizer, fp16 --------------------------------------------------------------


def test_scheduler_follows_the_ds_schedule_and_the_client_optimizer_works():
    from polytrain.deepspeed import load_ds_config

    config = _mlp_config(scheduler={"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 2, "total_num_steps": 6, "warmup_max_lr": 1e-2, "warmup_type": "linear"}})
    schedule = load_ds_config(config, world_size=1).scheduler
    engine, optimizer, _, scheduler = polytrain.initialize(model=_mlp(), config=config)
    lrs = []
    for step in range(6):
        lrs.append(scheduler.get_last_lr()[0])
        _mlp_train(engine, 1, first_step=step)
    assert lrs == [schedule.lr_at(s) for s in range(6)] and lrs[-1] < lrs[2]

    client_cfg = {k: v for k, v in _mlp_config().items() if k not in ("optimizer", "scheduler")}
    model = _mlp()
    client = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, optimizer, _, scheduler = polytrain.initialize(model=model, optimizer=client,
                                                           config=client_cfg)
    assert optimizer is client and scheduler is None
    before = [p.detach().clone() for p in model.parameters()]
    _mlp_train(engine, 1)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert engine.get_lr() == [0.05]
    with pytest.raises(ConfigError, match="keep one"):
        polytrain.initialize(model=_mlp(), optimizer=client, config=_mlp_config())


def test_fp16_overflow_skips_the_step_and_the_scheduler():
    from polytrain.backend import get_accelerator

    if torch.float16 not in get_accelerator().autocast_dtypes():
        pytest.skip("this torch build has no fp16 autocast on this device")
    config = _mlp_config(train_micro_batch_size_per_gpu=8,
                         fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, _, _, scheduler = polytrain.initialize(model=_mlp(), config=config)
    x, y = _mlp_data()
    weights = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(((engine(x[:8]) - y[:8]) ** 2).mean() * float("inf"))
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    assert engine.loss_scale == 2.0**7 and scheduler.steps == 0 and engine.global_steps == 1
    assert engine.get_global_grad_norm() is None
    assert all(torch.equal(a, b) for a, b in zip(weights, engine.module.parameters()))
    _mlp_train(engine, 1)
    assert engine.was_step_applied() and scheduler.steps == 1 and engine.get_global_grad_norm() > 0


# ----- checkpoints and batch sizes --------------------------------------------------------------------


def test_checkpoint_round_trip(tmp_path):
    engine, *_ = polytrain.initialize(model=_mlp(), config=_mlp_config())
    _mlp_train(engine, 3)
    engine.save_checkpoint(tmp_path, client_state={"epoch": 2, "note": "hi"})
    engine.save_checkpoint(tmp_path, tag="side", save_latest=False)
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "latest", "side"]
    lr = engine.get_lr()
    expected = _mlp_train(engine, 3, first_step=3)

    resumed, *_ = polytrain.initialize(model=_mlp(seed=5), config=_mlp_config())
    path, client_state = resumed.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step3") and client_state == {"epoch": 2, "note": "hi"}
    assert resumed.global_steps == 3 and resumed.lr_scheduler.steps == 3 and resumed.get_lr() == lr
    assert _mlp_train(resumed, 3, first_step=3) == pytest.approx(expected, rel=1e-6)

    # Weights alone into a new engine: its optimizer stays fresh (Adam's first update is t = 1).
    fresh, *_ = polytrain.initialize(model=_mlp(seed=5), config=_mlp_config())
    fresh.load_checkpoint(tmp_path, load_module_only=True)
    assert fresh.global_steps == 0 and {float(s["step"]) for s in fresh.optimizer.state.values()} <= {0.0}

    assert resumed.load_checkpoint(tmp_path / "nothing") == (None, None)
    with pytest.raises(CheckpointError, match="not a polytrain engine checkpoint"):
        resumed.load_checkpoint(tmp_path, tag="missing")


@pytest.mark.parametrize("config, sizes", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, (16, 2, 8)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, (16, 4, 4)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, (6, 3, 2)),
    ({"train_batch_size": 5}, (5, 5, 1)),
])
def test_batch_size_accessors_follow_deepspeed(config, sizes):
    engine, *_ = polytrain.initialize(model=_mlp(), config=config)
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == sizes
    assert engine.optimizer is None and engine.world_size == 1


def test_bad_configs_fail_with_one_line(tmp_path):
    with pytest.raises(ConfigError, match="set train_batch_size to 8 or 12") as e:
        polytrain.initialize(model=_mlp(), config={"train_batch_size": 10,
                                                   "train_micro_batch_size_per_gpu": 4})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):
        polytrain.initialize(model=_mlp(), config=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="no DeepSpeed config"):
        polytrain.initialize(model=_mlp())


def test_training_data_gives_a_sharded_loader():
    x, y = _mlp_data(20)
    data = torch.utils.data.TensorDataset(x, y)
    _, _, loader, _ = polytrain.initialize(model=_mlp(), training_data=data,
                                           config={"train_micro_batch_size_per_gpu": 4})
    batches = list(loader)
    assert len(batches) == 5 and batches[0][0].shape == (4, 8)
    seen = torch.cat([b[0] for b in batches])
    assert sorted(seen[:, 0].tolist()) == sorted(x[:, 0].tolist())
