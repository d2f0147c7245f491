"""Decoding's few-row products: F.linear with all threads, with one, split over threads, and
streamed through polytrain's host kernel.

    python benchmarks/threaded_matmul.py                       # llama 125m's weight shapes, rows 1 and 8
    python benchmarks/threaded_matmul.py --rows 1,2,4,8,16 --dtype bf16
    python benchmarks/threaded_matmul.py --rounds 1 --megabytes 16   # a quick check it runs

For each weight shape, enough distinct random weights to make about --megabytes of them
are multiplied by the same (rows, in) input one after another, as a decoding step reads a
model's weights, so that no weight is measured hot in the cache. Four ways, alternating
within each round: F.linear with torch's threads, F.linear with one thread,
`polytrain.inference.threaded_matmul.split_linear` with one block per thread, and
`polytrain.backend.host_matmul.thin_linear` (left out where it cannot be built). Reported: the
weight bytes read per second (median and spread over rounds), the split's and the kernel's
speedups over F.linear, whether the split's output equals F.linear's bitwise, the kernel's
largest difference from F.linear relative to the output's largest value, and, for scale, the
rate at which the memory gives a --megabytes tensor to `sum`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.nn.functional as F

from polytrain.backend import host_matmul
from polytrain.inference.threaded_matmul import split_linear

SHAPES = ((32000, 768), (2048, 768), (768, 2048), (768, 768), (256, 768))  # llama 125m: out, in


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8", help="comma list of row counts (decoding's batch)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--megabytes", type=int, default=400, help="of distinct weights per shape")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    return p.parse_args()


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ways_for(x: torch.Tensor, weights: list[torch.Tensor], threads: int, kernel: bool) -> dict:
    """name -> a function multiplying x by every weight in turn."""
    def one_thread():
        torch.set_num_threads(1)
        try:
            for w in weights:
                F.linear(x, w)
        finally:
            torch.set_num_threads(threads)

    ways = {"linear": lambda: [F.linear(x, w) for w in weights], "linear, 1 thread": one_thread,
            "split": lambda: [split_linear(x, w, threads) for w in weights]}
    if kernel:
        ways["stream"] = lambda: [host_matmul.thin_linear(x, w) for w in weights]
    return ways


def main() -> None:
    args = parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    threads = torch.get_num_threads()
    kernel = host_matmul.available()
    load = os.getloadavg()[0]
    big = torch.ones(args.megabytes * 2 ** 18)  # float32: --megabytes MiB
    big.sum()
    sum_gbs = statistics.median(big.nbytes / seconds(big.sum) / 1e9 for _ in range(args.rounds))
    del big
    rows_list = [int(r) for r in args.rows.split(",")]
    lines = []
    for out_f, in_f in SHAPES:
        count = max(1, args.megabytes * 2 ** 20 // (out_f * in_f * dtype.itemsize))
        gen = torch.Generator().manual_seed(out_f + in_f)
        weights = [torch.randn(out_f, in_f, generator=gen).to(dtype) for _ in range(count)]
        gb = count * out_f * in_f * dtype.itemsize / 1e9
        for rows in rows_list:
            x = torch.randn(rows, in_f, generator=gen).to(dtype)
            same = all(torch.equal(split_linear(x, w, threads), F.linear(x, w)) for w in weights[:2])
            ways = ways_for(x, weights, threads, kernel)
            for fn in ways.values():
                fn()
            rates = {name: [] for name in ways}
            for r in range(args.rounds):
                names = list(ways)[r % len(ways):] + list(ways)[:r % len(ways)]
                for name in names:
                    rates[name].append(gb / seconds(ways[name]))
            med = {k: statistics.median(v) for k, v in rates.items()}
            cells = " | ".join(f"{med[k]:.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in rates.items())
            ratios = f"{med['split'] / med['linear']:.2f}x"
            if kernel:
                reference = F.linear(x.float(), weights[0].float())
                diff = (host_matmul.thin_linear(x, weights[0]).float() - reference).abs().max()
                ratios += f" | {med['stream'] / med['linear']:.2f}x | {diff / reference.abs().max():.1e}"
            lines.append(f"| ({out_f}, {in_f}) | {rows} | {cells} | {ratios} | {same} |")
    print(f"\n{datetime.date.today()}, {threads} threads, torch {torch.__version__}, {args.dtype}, load average "
          f"{load:.1f} at start, {os.getloadavg()[0]:.1f} at the end; {args.megabytes} MiB of weights per shape, "
          f"median (spread) of {args.rounds} rounds; `sum` of {args.megabytes} MiB of fp32: {sum_gbs:.1f} GB/s\n")
    stream = (" stream (host kernel) |", " stream / F.linear | stream's largest difference |", " ---: | ---: | ---: |")
    stream = stream if kernel else ("", "", "")
    print(f"| weight (out, in) | rows | F.linear GB/s | F.linear, 1 thread | split over threads |{stream[0]} "
          f"split / F.linear |{stream[1]} split bitwise equal |\n| --- | ---: | ---: | ---: | ---: |{stream[2]} ---: "
          "| --- |")
    if not kernel:
        print("(the host kernel could not be built here: no stream column)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
