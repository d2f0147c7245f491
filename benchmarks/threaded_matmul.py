"""Decoding's few-row products: F.linear with all threads, with one, and split over threads.

    python benchmarks/threaded_matmul.py                       # llama 125m's weight shapes, rows 1 and 8
    python benchmarks/threaded_matmul.py --rounds 1 --megabytes 16   # a quick check it runs

For each weight shape, enough distinct random weights to make about --megabytes of them
are multiplied by the same (rows, in) input one after another, as a decoding step reads a
model's weights, so that no weight is measured hot in the cache. Three ways, alternating
within each round: F.linear with torch's threads, F.linear with one thread, and
`polytrain.inference.threaded_matmul.split_linear` with one block per thread. Reported: the
weight bytes read per second (median and spread over rounds), the split's speedup over
F.linear, whether the split's output equals F.linear's bitwise, and, for scale, the rate at
which the memory gives a --megabytes tensor to `sum`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.nn.functional as F

from polytrain.inference.threaded_matmul import split_linear

SHAPES = ((32000, 768), (2048, 768), (768, 2048), (768, 768), (256, 768))  # llama 125m: out, in


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8", help="comma list of row counts (decoding's batch)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--megabytes", type=int, default=400, help="of distinct weights per shape")
    return p.parse_args()


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    threads = torch.get_num_threads()
    load = os.getloadavg()[0]
    big = torch.ones(args.megabytes * 2 ** 18)  # float32: --megabytes MiB
    big.sum()
    sum_gbs = statistics.median(big.nbytes / seconds(big.sum) / 1e9 for _ in range(args.rounds))
    del big
    rows_list = [int(r) for r in args.rows.split(",")]
    lines = []
    for out_f, in_f in SHAPES:
        count = max(1, args.megabytes * 2 ** 20 // (out_f * in_f * 4))
        gen = torch.Generator().manual_seed(out_f + in_f)
        weights = [torch.randn(out_f, in_f, generator=gen) for _ in range(count)]
        gb = count * out_f * in_f * 4 / 1e9
        for rows in rows_list:
            x = torch.randn(rows, in_f, generator=gen)
            same = all(torch.equal(split_linear(x, w, threads), F.linear(x, w)) for w in weights[:2])

            def one_thread():
                torch.set_num_threads(1)
                try:
                    for w in weights:
                        F.linear(x, w)
                finally:
                    torch.set_num_threads(threads)

            ways = {"linear": lambda: [F.linear(x, w) for w in weights], "linear, 1 thread": one_thread,
                    "split": lambda: [split_linear(x, w, threads) for w in weights]}
            for fn in ways.values():
                fn()
            rates = {name: [] for name in ways}
            for r in range(args.rounds):
                names = list(ways)[r % 3:] + list(ways)[:r % 3]
                for name in names:
                    rates[name].append(gb / seconds(ways[name]))
            med = {k: statistics.median(v) for k, v in rates.items()}
            cells = " | ".join(f"{med[k]:.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in rates.items())
            lines.append(f"| ({out_f}, {in_f}) | {rows} | {cells} | {med['split'] / med['linear']:.2f}x | {same} |")
    print(f"\n{datetime.date.today()}, {threads} threads, torch {torch.__version__}, load average {load:.1f} at "
          f"start, {os.getloadavg()[0]:.1f} at the end; {args.megabytes} MiB of weights per shape, median "
          f"(spread) of {args.rounds} rounds; `sum` of {args.megabytes} MiB: {sum_gbs:.1f} GB/s\n")
    print("| weight (out, in) | rows | F.linear GB/s | F.linear, 1 thread | split over threads | split / F.linear "
          "| bitwise equal |\n| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
