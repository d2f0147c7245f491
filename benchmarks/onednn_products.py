"""One layer's fp32 products on oneDNN against the BLAS, the ones `train.fp32_gemm` routes.

    python benchmarks/onednn_products.py                    # gpt2 small's layers at tp 2 and gpt2 124m's: ~1 min
    python benchmarks/onednn_products.py --rounds 1 --shapes 64,32,48   # a quick check it runs

For each case (tokens N, the layer's input width, its output width): a Linear layer's forward
product x (N, in) @ W (out, in)^T and its input-gradient product dy (N, out) @ W, through autograd
as a training step runs them: with `backend.host_gemm.onednn_linear` (oneDNN's matmul) and with
F.linear (torch's BLAS: MKL in x86 builds), the two alternating within each round, on torch's
threads (one by default: a rank of a 2-rank job on 2 cores). The weight takes no gradient here:
its product stays on the BLAS either way. Reports median milliseconds with their spread, the
speedup, the largest difference, and GFLOP/s of each way's median (4 N in out FLOPs: two products).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from paired_ops import alternate, cell, machine_line, speedup

from polytrain.backend import host_gemm

CASES = "2048,384,576;2048,192,384;2048,384,768;2048,768,384;2048,768,2304;2048,768,3072;2048,3072,768"
"""A micro-batch of 8 x 256 tokens: GPT-2 small's qkv, attention output, fc1 and fc2 at tp 2 (dim
384, 6 heads: each rank holds half of qkv's and fc1's outputs and of proj's and fc2's inputs),
then GPT-2 124m's (dim 768) qkv, fc1 and fc2 unsharded."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=CASES, help="';'-separated tokens,in,out")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def step(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, onednn: bool):
    """Forward + input-gradient product one way: (ms, output, input gradient)."""
    leaf = x.clone().requires_grad_()
    start = time.perf_counter()
    out = host_gemm.onednn_linear(leaf, weight) if onednn else F.linear(leaf, weight)
    out.backward(grad)
    return (time.perf_counter() - start) * 1e3, out.detach(), leaf.grad


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if not host_gemm.onednn_available():
        raise SystemExit("error: this build of torch has no oneDNN")
    load = os.getloadavg()[0]
    rows = []
    for spec in args.shapes.split(";"):
        n, fan_in, fan_out = (int(v) for v in spec.split(","))
        gen = torch.Generator().manual_seed(n + fan_in + fan_out)
        x = torch.randn(n, fan_in, generator=gen)
        weight = torch.randn(fan_out, fan_in, generator=gen) / fan_in ** 0.5
        grad = torch.randn(n, fan_out, generator=gen)
        ways = {"blas": False, "onednn": True}
        results = {name: step(x, weight, grad, onednn)[1:] for name, onednn in ways.items()}  # warm-up
        times = alternate({name: (lambda onednn=onednn: step(x, weight, grad, onednn)[0])
                           for name, onednn in ways.items()}, args.rounds)
        diff = max((a - b).abs().max().item() for a, b in zip(results["blas"], results["onednn"]))
        gflops = {name: 4 * n * fan_in * fan_out / statistics.median(t) / 1e6 for name, t in times.items()}
        rows.append(f"| {n}, {fan_in}, {fan_out} | {cell(times['blas'], 3)} | {cell(times['onednn'], 3)} | "
                    f"{speedup(times['blas'], times['onednn'])} | {gflops['blas']:.0f} / {gflops['onednn']:.0f} | "
                    f"{diff:.1e} |")
    print(machine_line(load, args.rounds, "forward + input-gradient products, ms"))
    print("| N, in, out | BLAS | oneDNN | speedup | GFLOP/s BLAS / oneDNN | largest difference |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
