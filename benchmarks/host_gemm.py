"""A Linear layer's forward and backward in 16 bits against the same products as fp32 GEMMs
(train.matmul_fp32, `polytrain.backend.host_gemm.linear`).

    python benchmarks/host_gemm.py                      # llama tiny's layers at 2048 tokens, bf16
    python benchmarks/host_gemm.py --dtype fp16
    python benchmarks/host_gemm.py --rounds 1 --shapes 64,32,48   # a quick check it runs

For each (tokens, in, out): F.linear on 16-bit x (tokens, in), weight (out, in) and bias (what a
16-bit layer runs, torch's own 16-bit GEMM) and host_gemm.linear on the same tensors (widened to
fp32, products as fp32 GEMMs, results rounded back), each a forward and a backward of a fixed
gradient, alternating within each round on torch's threads. Reports milliseconds (median and
spread over rounds), the fp32 way's speedup, and each way's largest error in the output against
float64 products of the same 16-bit operands. Whether the host has 16-bit dot-product
instructions (host_gemm.emulates) is printed with the table: where it has them, 16-bit wins.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from polytrain.backend import host_gemm

SHAPES = "2048,192,320;2048,192,192;2048,192,1024;2048,512,192;2048,768,2304;2048,768,3072;2048,3072,768"
"""llama tiny's attention in and out, feed-forward in and out at micro-batch 8 x seq 256; gpt2
125m's attention in and feed-forward in and out."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="';'-separated tokens,in,out")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    load = os.getloadavg()[0]
    ways = {args.dtype: lambda x, w, b: F.linear(x, w, b), "fp32": lambda x, w, b: host_gemm.linear(x, w, b, dtype)}
    lines = []
    for spec in args.shapes.split(";"):
        n, k, m = (int(v) for v in spec.split(","))
        gen = torch.Generator().manual_seed(n + k * m)
        x = torch.randn(n, k, generator=gen).to(dtype).requires_grad_()
        w = (torch.randn(m, k, generator=gen) * k ** -0.5).to(dtype).requires_grad_()
        b = torch.randn(m, generator=gen).to(dtype).requires_grad_()
        grad = torch.randn(n, m, generator=gen).to(dtype)
        exact = x.detach().double() @ w.detach().double().t() + b.detach().double()
        errors = {name: (way(x, w, b).detach().double() - exact).abs().max().item() for name, way in ways.items()}

        times = {name: [] for name in ways}
        for r in range(-1, args.rounds):  # round -1 warms up
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                x.grad = w.grad = b.grad = None
                start = time.perf_counter()
                ways[name](x, w, b).backward(grad)
                if r >= 0:
                    times[name].append((time.perf_counter() - start) * 1e3)
        med = {name: statistics.median(v) for name, v in times.items()}
        cells = " | ".join(f"{med[name]:.2f} ({min(v):.2f}-{max(v):.2f})" for name, v in times.items())
        lines.append(f"| {n}, {k}, {m} | {cells} | {med[args.dtype] / med['fp32']:.2f}x | "
                     f"{errors[args.dtype]:.2e} / {errors['fp32']:.2e} |")
    print(f"\n{datetime.date.today()}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}, host emulates {args.dtype} GEMMs: {host_gemm.emulates(dtype)}, "
          f"load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at the end; forward + backward, "
          f"median (spread) of {args.rounds} rounds, ms\n")
    print(f"| tokens, in, out | {args.dtype} GEMMs | fp32 GEMMs | fp32 speedup | max output error "
          f"{args.dtype} / fp32 |\n| --- | ---: | ---: | ---: | --- |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
