"""The chunked loss with its softmax on the host operators against the same loss in torch ops.

    python benchmarks/host_cross_entropy.py                  # llama tiny's and a 32K vocabulary's heads
    python benchmarks/host_cross_entropy.py --rounds 1 --shapes 300,48,500   # a quick check it runs

For each shape (tokens N, width D, vocabulary V) and dtype (fp32, bf16), polytrain's chunked
loss (`linear_cross_entropy`: the output projection and cross-entropy a chunk of tokens at a
time) computes the mean loss of hidden (N, D) @ weight (V, D).T and its gradients, with each
chunk's log-sum-exp and softmax gradient on the host operators (backend/host_cross_entropy.py,
what training runs on the host CPU) and with torch's ops (what it ran before, and runs
elsewhere); the two alternate within each round, on torch's threads (one by default: a rank of
a 2-rank job on 2 cores). Reports median milliseconds of forward + backward with their spread,
the speedup, and the largest difference between the two ways' losses and gradients.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from paired_ops import host_against_torch, machine_line, require_host_kernels

from polytrain.backend import host_cross_entropy
from polytrain.distributed import linear_cross_entropy as lce

SHAPES = "2048,192,4096;2048,512,32000;2048,768,32000"
"""llama tiny's micro-batch (8 x 256 tokens) and head; a 32K vocabulary at widths 512 and 768."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="';'-separated tokens,width,vocabulary")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def step(hidden, weight, targets, host: bool):
    """Forward + backward of the chunked loss, one way; (ms, loss, grad of hidden, grad of weight)."""
    original = host_cross_entropy.applies
    if not host:
        host_cross_entropy.applies = lambda logits: False
    lce._kernels.cache_clear()
    try:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        start = time.perf_counter()
        loss = lce.linear_cross_entropy(h, w, None, targets)
        loss.backward()
        ms = (time.perf_counter() - start) * 1e3
    finally:
        host_cross_entropy.applies = original
        lce._kernels.cache_clear()
    return ms, loss.detach(), h.grad, w.grad


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    require_host_kernels()
    load = os.getloadavg()[0]
    rows = []
    for spec in args.shapes.split(";"):
        n, d, v = (int(x) for x in spec.split(","))
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(n + d + v)
            hidden = torch.randn(n, d, generator=gen).to(dtype)
            weight = (d ** -0.5 * torch.randn(v, d, generator=gen)).to(dtype)
            targets = torch.randint(0, v, (n,), generator=gen)
            compared = host_against_torch(lambda host: step(hidden, weight, targets, host), args.rounds, digits=1)
            rows.append(f"| {n}, {d}, {v} | {str(dtype).removeprefix('torch.')} | {compared} |")
    print(machine_line(load, args.rounds, "forward + backward, ms"))
    print("| N, D, V | dtype | torch ops | host operators | speedup | largest difference |\n"
          "| --- | --- | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
