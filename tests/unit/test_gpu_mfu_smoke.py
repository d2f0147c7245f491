"""benchmarks/gpu_mfu.py keeps working: its CPU smoke mode, compile off and on, with a profile."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_mfu.py"


def test_cpu_smoke_mode_measures_every_configuration(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_mfu", SCRIPT)
    gpu_mfu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_mfu)
    out = tmp_path / "mfu.json"
    rows = gpu_mfu.main(["--cpu-smoke", "--seqs", "64", "--backend", "aot_eager", "--profile", "--json", str(out)])
    assert [(r["size"], r["seq"], r["compile"]) for r in rows] == [("tiny", 64, False), ("tiny", 64, True)]
    for row in rows:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] <= 1 and math.isfinite(row["loss"])
        assert row["flops_per_token"] > 6 * row["params"] * 0.5  # 6N + attention, N without the embedding
        assert abs(sum(fraction for _, fraction in row["profile"]) - 1) < 1e-6
    assert rows[1]["graph_breaks"] == 0 and rows[1]["compile_s"] > 0
    assert json.loads(out.read_text())[0]["size"] == "tiny"
