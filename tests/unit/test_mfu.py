"""MFU never above 100%: a step faster than a measured peak raises it, a datasheet peak caps it,
and the start-up line names the peak's source."""

import types

import pytest
import torch

from polytrain.backend import CPUAccelerator, datasheet_peak, flops
from polytrain.train.mfu import MFU
from polytrain.train.progress import ProgressBar
from polytrain.train.trainer import Trainer


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYTRAIN_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def busy_host(monkeypatch):
    """Every peak measurement reads 1 GFLOP/s, as on a host busy with other work."""
    monkeypatch.setattr(flops, "_machine_is_quiet", lambda: False)
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype, **kw: 1e9)


def _stand_in_trainer(acc, fp32_matmuls: bool = False):
    """What Trainer._mfu_meter reads, and the per-device rate train() hands the meter."""
    trainer = types.SimpleNamespace(acc=acc, autocast_dtype=torch.bfloat16, fp32_matmuls=fp32_matmuls,
                                    flops_per_token=1e6, world=types.SimpleNamespace(world_size=2))
    trainer.rate = lambda tokens_per_s: tokens_per_s * trainer.flops_per_token / trainer.world.world_size
    return trainer


def test_a_step_faster_than_the_measured_peak_reads_100_percent_and_raises_the_peak(busy_host, tmp_path, capsys):
    trainer = _stand_in_trainer(CPUAccelerator())
    mfu = Trainer._mfu_meter(trainer)
    assert mfu.peak.flops == 1e9
    assert mfu.describe() == (f"MFU against 0.001 TFLOP/s bf16 (measured on this CPU, best of 1 run, cached in "
                              f"{tmp_path / 'cache' / 'peak_flops.json'})")
    assert mfu.of(trainer.rate(1000.0)) == (0.5, None)  # 0.5 GFLOP/s a device
    value, note = mfu.of(trainer.rate(4000.0))  # 2 GFLOP/s a device: the busy host's 1 was low
    assert value == 1.0 and "above the measured peak (0.001" in note and "raised to a training step's 0.002" in note
    bar = ProgressBar(total_steps=10, plain_interval_s=0)
    bar.update(1, loss=3.0, tokens_per_s=4000.0, mfu=value)
    assert "MFU 100.0%" in capsys.readouterr().out
    assert mfu.of(trainer.rate(3000.0)) == (0.75, None)  # later steps are held to the raised peak
    # The next run starts from the raised figure, though its own measurement reads 1e9 again.
    later = Trainer._mfu_meter(_stand_in_trainer(CPUAccelerator()))
    assert later.peak.flops == 2e9 and "best of 2 runs, raised to a training step's 0.002 TFLOP/s" in later.describe()


def test_mfu_never_exceeds_100_percent_whatever_the_step(busy_host):
    mfu = MFU(flops.measured_peak(torch.float32))
    for rate in (1e8, 5e9, 2e9, 7e9, 3e10, 1e9):
        value, _ = mfu.of(rate)
        assert 0 < value <= 1.0
    assert mfu.peak.flops == 3e10


def test_a_datasheet_peak_is_never_raised_mfu_is_capped_and_the_note_given_once():
    mfu = MFU(datasheet_peak("NVIDIA H100 80GB HBM3", torch.bfloat16))
    assert mfu.describe() == "MFU against 989 TFLOP/s bf16 (H100 SXM datasheet, dense)"
    assert mfu.of(494.5e12) == (0.5, None)
    value, note = mfu.of(1.2e15)
    assert value == 1.0 and "above 989 TFLOP/s bf16 (H100 SXM datasheet, dense)" in note
    assert mfu.of(1.1e15) == (1.0, None)  # said once
    assert mfu.peak.flops == 989e12

