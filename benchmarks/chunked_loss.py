"""Output projection + cross-entropy: the plain path against polytrain's chunked loss.

    python benchmarks/chunked_loss.py            # ~6 min on 2 cores (the 8K x 32K case is most of it)

For each shape (tokens N, width D, vocabulary V) both ways compute the mean loss of
hidden (N, D) @ weight (V, D).T against random targets and its gradients; the plain
way as a script does (logits -> F.cross_entropy -> backward), the chunked way with
`polytrain.train.chunked_loss.linear_cross_entropy`. Reported: the median seconds of a
forward + backward over --reps runs (one thread, as each rank of a 2-rank job on this
machine has), and the peak resident memory the step adds (VmHWM reset through
/proc/self/clear_refs before each step; Linux only), each way in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [(2048, 192, 4096), (2048, 512, 32_000), (8192, 512, 32_000)]
"""llama tiny's micro-batch (8 x 256 tokens), and a 32K vocabulary at two batch sizes."""


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(n: int, d: int, v: int, mode: str, reps: int) -> dict:
    """One way, in this process: median seconds and the peak RSS (MiB) a step adds."""
    import torch
    import torch.nn.functional as F

    from polytrain.train.chunked_loss import linear_cross_entropy

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = (0.02 * torch.randn(v, d, generator=g)).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)

    def step() -> None:
        if mode == "plain":
            loss = F.cross_entropy(F.linear(hidden, weight).float(), targets)
        else:
            loss = linear_cross_entropy(hidden, weight, None, targets)
        loss.backward()

    step()  # first-touch allocations and the .grad buffers
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    before = _rss_kib("VmRSS")
    step()
    return {"seconds": statistics.median(seconds), "peak_mib": (_rss_kib("VmHWM") - before) / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)  # N D V mode
    args = p.parse_args()
    if args.worker:
        n, d, v, mode = args.worker
        print(json.dumps(measure(int(n), int(d), int(v), mode, args.reps)))
        return
    print("| tokens N | width D | vocabulary V | plain s | chunked s | time chunked/plain "
          "| plain peak MiB | chunked peak MiB | memory chunked/plain |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, d, v in SHAPES:
        got = {}
        for mode in ("plain", "chunked"):
            out = subprocess.run([sys.executable, __file__, "--reps", str(args.reps), "--worker",
                                  str(n), str(d), str(v), mode], check=True, capture_output=True, text=True)
            got[mode] = json.loads(out.stdout)
        plain, chunked = got["plain"], got["chunked"]
        print(f"| {n:,} | {d} | {v:,} | {plain['seconds']:.3f} | {chunked['seconds']:.3f} "
              f"| **{chunked['seconds'] / plain['seconds']:.2f}** | {plain['peak_mib']:,.0f} "
              f"| {chunked['peak_mib']:,.0f} | **{chunked['peak_mib'] / plain['peak_mib']:.2f}** |", flush=True)


if __name__ == "__main__":
    main()
