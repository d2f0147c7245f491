"""What the CUDA shim costs: the nanoGPT-style CUDA trainer under `polytrain run` against the
same script hand-edited for the CPU (tests/compat/programs/nanogpt_cpu_port.py), in tokens/s,
eager and under torch.compile.

    python benchmarks/compat_overhead.py [--rounds 3] [--iters 40] [--json out.json]

The model is nanoGPT's own CPU configuration from its README (block 64, batch 12, 4 layers,
4 heads, 128 wide), fp32 as on a CPU without autocast, one thread. Each round runs the shimmed
script and the port in turn, and takes the ratio per round so drift in the machine's load hits
both sides alike. Two figures per run:
- wall: the median step time the script reports after `--warmup` steps (compilation and
  first-touch allocation) -- the figure, on a quiet machine;
- cpu: CPU seconds per step, from a run of `--iters` steps less one of `--warmup` steps (same
  start-up and compilation), which other processes' load disturbs far less than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
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


def run(argv: list[str], iters: int, cache: str) -> tuple[list[float], float]:
    """One run: (its step times in ms, the CPU seconds it used)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, *argv, *CONFIG, f"--max_iters={iters}"],
                          capture_output=True, text=True, env=env, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[-1]} failed:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return [float(m[2]) for m in STEP.finditer(proc.stdout)], cpu


def measure(argv: list[str], iters: int, warmup: int, cache: str) -> tuple[float, float]:
    """(median wall ms per step after warmup, CPU ms per step) of the program `argv`."""
    times, cpu_long = run(argv, iters, cache)
    _, cpu_short = run(argv, warmup, cache)
    return statistics.median(times[warmup:]), (cpu_long - cpu_short) / (iters - warmup) * 1000


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
                shim = measure(["-m", "polytrain.cli", "run", str(SCRIPT), flag], args.iters,
                               args.warmup, work)
                plain = measure([str(port), flag], args.iters, args.warmup, work)
                rounds.append({f"{side}_{kind}_tokens_per_s": tokens / ms * 1000
                               for side, figures in (("shim", shim), ("port", plain))
                               for kind, ms in zip(("wall", "cpu"), figures)}
                              | {"wall_ratio": plain[0] / shim[0], "cpu_ratio": plain[1] / shim[1]})
            name = "compiled" if compiled else "eager"
            results[name] = {"rounds": rounds} | {
                f"median_{kind}_ratio": statistics.median(r[f"{kind}_ratio"] for r in rounds)
                for kind in ("wall", "cpu")}
            for kind in ("wall", "cpu"):
                per_round = ", ".join(f"{r[f'{kind}_ratio']:.3f}" for r in rounds)
                rate = statistics.median(r[f"shim_{kind}_tokens_per_s"] for r in rounds)
                print(f"{name} ({kind}): shim/port tokens/s ratio "
                      f"{results[name][f'median_{kind}_ratio']:.3f} (rounds: {per_round}; "
                      f"shim {rate:,.0f} tokens/s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
