"""metrics.jsonl, TensorBoard, loss.png and the progress bar."""

import io
import json

import pytest

from polytrain.config import load_config
from polytrain.train.metrics import MetricsLogger, plot_loss, read_metrics
from polytrain.train.progress import ProgressBar


def _train_row(step, loss):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens": step * 100,
            "tokens_per_s": 1234.5, "mfu": 0.31, "mem_gb": 1.5, "time": step * 0.1}


def test_rows_are_valid_json_with_nan_as_null(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=True)
    logger.log(_train_row(1, 3.5))
    logger.log(_train_row(2, float("nan")) | {"grad_norm": float("inf")})
    logger.log({"step": 2, "val_loss": 3.1, "time": 0.2})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # readable before close
    rows = [json.loads(line) for line in lines]  # strict JSON: NaN would not parse back as null
    assert rows[0]["loss"] == 3.5
    assert rows[1]["loss"] is None and rows[1]["grad_norm"] is None
    assert rows[2] == {"step": 2, "val_loss": 3.1, "time": 0.2}
    assert "NaN" not in "".join(lines) and "Infinity" not in "".join(lines)
    logger.close()


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=True)
    for step in range(1, 7):
        logger.log(_train_row(step, 4.0 - step * 0.1))
    logger.log({"step": 6, "val_loss": 3.0, "time": 1.0})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # a line cut short by a crash

    resumed = MetricsLogger(tmp_path, enabled=True, resume_step=4)
    resumed.log(_train_row(5, 3.4))
    resumed.close()
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert not list(tmp_path.glob("*.tmp"))

    MetricsLogger(tmp_path, enabled=True).close()  # a fresh start forgets the old run
    assert read_metrics(tmp_path) == []


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", enabled=False, cfg=load_config(None, ["--run.loggers", "tensorboard"]))
    logger.log(_train_row(1, 3.0))
    logger.close()
    assert not (tmp_path / "run").exists()


def test_plot_loss_writes_a_png(tmp_path):
    run = tmp_path / "my-run"
    logger = MetricsLogger(run, enabled=True)
    for step in range(1, 101):
        logger.log(_train_row(step, 10.0 / step))
        if step % 25 == 0:
            logger.log({"step": step, "val_loss": 11.0 / step, "time": step * 0.1})
    logger.close()
    plot_loss(run)
    out = plot_loss(run)  # redrawing over an existing plot works too
    data = out.read_bytes()
    assert out == run / "loss.png"
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(run.glob(".*.tmp"))


def test_plot_loss_before_any_row(tmp_path):
    assert plot_loss(tmp_path).read_bytes()[:4] == b"\x89PNG"


def test_tensorboard_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    logger = MetricsLogger(tmp_path, enabled=True, cfg=load_config(None, ["--run.loggers", "tensorboard"]))
    logger.log(_train_row(1, 3.0))
    logger.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_progress_bar_prints_plain_lines_when_not_a_tty(capsys):
    bar = ProgressBar(total_steps=100, initial=0, enabled=True, plain_interval_s=3600)
    bar.update(10, loss=3.25, tokens_per_s=12345.0, mfu=0.412, mem_gb=1.5)
    bar.update(20, loss=3.0, tokens_per_s=12000.0, mfu=0.41, mem_gb=1.5)  # throttled
    bar.write("validation loss 3.1")
    bar.close()  # shows the throttled step 20
    lines = capsys.readouterr().out.splitlines()
    assert "\r" not in "".join(lines)
    assert lines[0].startswith("step 10/100") and "loss 3.2500" in lines[0]
    assert "12.3k tok/s" in lines[0] and "MFU 41.2%" in lines[0] and "1.50 GB" in lines[0]
    assert "ETA" in lines[0]
    assert lines[1] == "validation loss 3.1"
    assert lines[2].startswith("step 20/100") and len(lines) == 3


def test_progress_bar_on_a_terminal_uses_tqdm():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    bar = ProgressBar(total_steps=50, initial=10, enabled=True, file=out)
    bar.update(20, loss=2.5, tokens_per_s=900.0, mfu=None, mem_gb=None)
    bar.close()
    text = out.getvalue()
    assert "20/50" in text and "loss 2.5000" in text and "900 tok/s" in text
    assert "MFU" not in text


def test_disabled_progress_bar_prints_nothing(capsys):
    bar = ProgressBar(total_steps=10, initial=0, enabled=False)
    bar.update(5, loss=1.0, tokens_per_s=1.0, mfu=0.1, mem_gb=1.0)
    bar.write("hidden")
    bar.close()
    assert capsys.readouterr().out == ""
