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
- cpu: CPU time per step over the same steps, read from /proc, which other processes' load
  disturbs far less than wall time (one thread: on a quiet machine the two agree).
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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time the process `pid` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(argv: list[str], iters: int, warmup: int, cache: str) -> tuple[float, float]:
    """(median wall ms per step after warmup, CPU ms per step over the same steps) of one run.

    The CPU figure is read from /proc when the program reports the end of its warmup and of
    its last step, so start-up and compilation are left out of it."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, *argv, *CONFIG, f"--max_iters={iters}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    times, cpu = [], {}
    for line in proc.stdout:
        step = STEP.search(line)
        if step is None:
            continue
        times.append(float(step[2]))
        if int(step[1]) in (warmup - 1, iters - 1):
            cpu[int(step[1])] = _cpu_seconds(proc.pid)
    stderr = proc.stderr.read()
    if proc.wait() != 0 or len(cpu) != 2:
        raise SystemExit(f"{argv[-1]} failed:\n{stderr[-3000:]}")
    per_step = (cpu[iters - 1] - cpu[warmup - 1]) / (iters - warmup) * 1000
    return statistics.median(times[warmup:]), per_step


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
