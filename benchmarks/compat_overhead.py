"""What the CUDA shim costs: the nanoGPT-style CUDA trainer under `polytrain run` against the
same script hand-edited for the CPU (tests/compat/programs/nanogpt_cpu_port.py), in tokens/s,
eager and under torch.compile.

    python benchmarks/compat_overhead.py [--rounds 3] [--iters 40] [--json out.json]

The model is nanoGPT's own CPU configuration from its README (block 64, batch 12, 4 layers,
4 heads, 128 wide), fp32 as on a CPU without autocast. Each round runs the shimmed script and
the port in turn; a run's figure is its median step time after `--warmup` steps (compilation and
first-touch allocation), and the ratio is taken per round so drift in the machine's load hits
both sides alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.compat.programs.nanogpt_cpu_port import SCRIPT, port_to_cpu  # noqa: E402

CONFIG = ["--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
          "--dtype=float32"]
STEP = re.compile(r"iter (\d+): loss \S+, time (\S+)ms")


def step_ms(argv: list[str], iters: int, warmup: int, cache: str) -> float:
    """Median step time (ms) of one run after `warmup` steps."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *argv, *CONFIG, f"--max_iters={iters}"],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[-1]} failed:\n{proc.stderr[-3000:]}")
    times = [float(m[2]) for m in STEP.finditer(proc.stdout) if int(m[1]) >= warmup]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tokens = 12 * 64
    with tempfile.TemporaryDirectory() as work:
        port = Path(work) / "nanogpt_cpu.py"
        port.write_text(port_to_cpu(SCRIPT.read_text()))
        results = {}
        for compiled in (False, True):
            flag = f"--compile={compiled}"
            rounds = []
            for _ in range(args.rounds):
                shim = step_ms(["-m", "polytrain.cli", "run", str(SCRIPT), flag], args.iters,
                               args.warmup, work)
                plain = step_ms([str(port), flag], args.iters, args.warmup, work)
                rounds.append({"shim_tokens_per_s": tokens / shim * 1000,
                               "port_tokens_per_s": tokens / plain * 1000, "ratio": plain / shim})
            name = "compiled" if compiled else "eager"
            results[name] = {"rounds": rounds,
                             "median_ratio": statistics.median(r["ratio"] for r in rounds)}
            per_round = ", ".join(f"{r['ratio']:.3f}" for r in rounds)
            shim_rate = statistics.median(r["shim_tokens_per_s"] for r in rounds)
            print(f"{name}: shim/port tokens/s ratio {results[name]['median_ratio']:.3f} "
                  f"(rounds: {per_round}; shim {shim_rate:,.0f} tokens/s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
