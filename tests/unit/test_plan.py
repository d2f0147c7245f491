"""`polytrain plan`: devices and units, the layouts it proposes, the model-state and communication
formulas against the ZeRO paper's and the benchmarks' own, the ranking and the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from polytrain.cli import main
from polytrain.config import load_config
from polytrain.errors import ConfigError
from polytrain.plan import Cluster, device_spec, evaluate, model_shape, plan
from polytrain.plan.devices import GiB, parse_link, parse_rate, parse_size, with_overrides
from polytrain.plan.layouts import Layout, layout_from_config
from polytrain.plan.memory import chunk_tokens, in_flight
from polytrain.train.startup import plan_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed
from benchmarks.tp_comm import analytic_bytes  # noqa: E402
from benchmarks.zero_memory_comm import expected_comm  # noqa: E402

H100 = device_spec("H100")


def _cfg(*args: str):
    return load_config(None, list(args))


def test_sizes_rates_and_links():
    assert parse_size("80GB") == 80 * GiB and parse_size("512MiB") == 512 * 2**20
    assert parse_rate("400Gb/s", "x") == 50e9 and parse_rate("450GB/s", "x") == 450e9
    assert parse_link("intra=nvlink,inter=400Gb/s") == {"intra": 450e9, "inter": 50e9}
    custom = with_overrides(Cluster(H100, 16, 2), memory="40GB", link="100GB/s", flops="500T").device
    assert (custom.memory_bytes, custom.intra_node_bw, custom.flops("bf16")) == (40 * GiB, 100e9, 500e12)
    with pytest.raises(ConfigError, match="unknown device 'B300'"):
        device_spec("B300")
    with pytest.raises(ConfigError, match="--devices = 12 does not split evenly over --nodes = 8"):
        Cluster(H100, 12, 8)
    with pytest.raises(ConfigError, match="--device-memory = 'lots' is not a size"):
        parse_size("lots")


def test_proposed_layouts_are_config_keys_start_up_accepts():
    cfg = _cfg("--model.size", "small", "--train.global_batch_size", "16")
    estimates = plan(cfg, Cluster(H100, 4))
    assert len(estimates) > 50
    kinds = {(e.layout.zero, e.layout.tp > 1, e.layout.pp > 1) for e in estimates}
    assert {(0, False, False), (1, False, False), (3, False, False), (0, True, False), (0, False, True),
            (3, True, True)} <= kinds
    for estimate in estimates[:: max(1, len(estimates) // 40)]:
        keys = estimate.as_json()
        overrides = [item for k, v in keys.items() if "." in k
                     for item in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]
        run = load_config(None, ["--model.size", "small", "--train.global_batch_size", "16", *overrides])
        plan_layout(run, 4)  # what the plan proposes, start-up runs
        assert layout_from_config(run, 4) == estimate.layout


def test_model_states_are_the_zero_formulas():
    """polytrain keeps fp32 weights and gradients (autocast computes in bf16). At the optimizer
    step Adam's states are 16 bytes a parameter at ZeRO-0, 4 + 16/N at ZeRO-1 and 2 (the whole
    gradients are freed as their buckets reduce: zero_memory_comm.py measured 4psi + 16psi/N for
    both), 16/N at ZeRO-3."""
    cfg = _cfg("--model.size", "1b", "--train.global_batch_size", "8", "--train.micro_batch_size", "1",
               "--train.precision", "bf16")
    shape = model_shape(cfg)
    psi, n = shape.num_params, 8
    states = ("weights", "weights (shards)", "master weights", "optimizer state", "gradients")
    for zero, per_param in ((0, 16), (1, 4 + 16 / n), (2, 4 + 16 / n), (3, 16 / n)):
        est = evaluate(cfg, shape, Layout(world=n, dp=n, zero=zero, micro_batch_size=1), Cluster(H100, n))
        step = est.memory.phases["optimizer step"]
        assert sum(step.get(k, 0.0) for k in states) == pytest.approx(per_param * psi, rel=1e-9), zero


def test_communication_is_what_the_benchmarks_check():
    cfg = _cfg("--model.size", "small", "--model.n_heads", "8", "--data.seq_len", "64",
               "--train.micro_batch_size", "2", "--train.global_batch_size", "4")
    shape = model_shape(cfg)
    tp = evaluate(cfg, shape, Layout(world=2, dp=1, tp=2, micro_batch_size=2, accum=2), Cluster(H100, 2))
    bench = analytic_bytes(cfg, 2, False, micro_batches=2, elem=4)
    assert tp.time.comm_bytes["tp"] == pytest.approx(bench["activations"] + bench["loss"], rel=1e-9)
    for zero in (0, 1, 2, 3):  # one micro-batch per step, fp32 weights, a reduce-scatter that is one
        dp = evaluate(cfg, shape, Layout(world=4, dp=4, zero=zero, micro_batch_size=1), Cluster(H100, 4))
        want = expected_comm(zero, 4, accum=1, psi=shape.num_params, psi_kept=0, gather_bytes=4, reduce_psi=1)
        assert dp.time.comm_bytes["dp"] == pytest.approx(want, rel=1e-9), zero


def test_pipeline_micro_batches_in_flight_and_bubble():
    base = dict(world=4, dp=1, pp=4, micro_batch_size=1, accum=8)
    assert [in_flight(Layout(**base), r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight(Layout(**base, pp_schedule="gpipe"), 3) == 8
    cfg = _cfg("--model.size", "small", "--model.n_layers", "8", "--train.global_batch_size", "8")
    shape = model_shape(cfg)
    bubbles = [evaluate(cfg, shape, Layout(world=4, dp=1, pp=4, pp_schedule=s, micro_batch_size=1, accum=8),
                        Cluster(H100, 4)).time.parts["pipeline bubble"] for s in ("1f1b", "interleaved")]
    assert bubbles[1] < bubbles[0]


def test_chunk_size_follows_the_trainer():
    from polytrain.distributed.linear_cross_entropy import chunk_tokens as trainer_rule

    for n, d, v in ((2048, 384, 8192), (100, 4096, 32000), (65536, 8192, 128256)):
        assert chunk_tokens(n, d, v) == trainer_rule(n, d, v)


def test_fixed_keys_and_ranking():
    cfg = _cfg("--model.size", "1b", "--data.seq_len", "2048", "--train.global_batch_size", "64",
               "--train.precision", "bf16", "--parallel.tp", "2")
    estimates = plan(cfg, Cluster(H100, 8))
    assert estimates and all(e.layout.tp == 2 for e in estimates)
    fits = [e for e in estimates if e.fits]
    assert fits == estimates[:len(fits)]
    assert [e.time.total for e in fits] == sorted(e.time.total for e in fits)


def test_command_line_json_and_nothing_fits(capsys):
    assert main(["plan", "--devices", "8", "--device", "H100", "--json", "--top", "3", "--model.size", "1b",
                 "--data.seq_len", "2048", "--train.global_batch_size", "64", "--train.precision", "bf16"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and rows[0]["fits"] and rows[0]["step_time_s"] <= rows[1]["step_time_s"]
    assert {"parallel.nproc", "parallel.tp", "parallel.zero", "train.micro_batch_size", "memory_gb",
            "step_time_s"} <= set(rows[0])
    assert main(["plan", "--devices", "1", "--device", "A100-40GB", "--device-memory", "24GB", "--model.size", "7b",
                 "--train.global_batch_size", "8"]) == 0
    out = capsys.readouterr().out
    assert "nothing fits. Closest:" in out
    assert main(["plan", "--devices", "2", "--device", "H800"]) == 2
    assert "error: unknown device 'H800'" in capsys.readouterr().err
