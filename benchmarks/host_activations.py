"""The feed-forward activations on the host operators against torch's ops.

    python benchmarks/host_activations.py                   # GPT-2 small/124m's and llama tiny/125m's
    python benchmarks/host_activations.py --rounds 1 --shapes gelu_tanh:400,48   # a quick check it runs

For each case (activation, tokens N, hidden width F) and dtype (fp32, bf16): the forward and
backward of GPT-2's tanh GELU, or of SwiGLU's silu(gate) * up, on an (N, F) activation, through
autograd as a training step runs it: with polytrain's host operators (backend/host_activations.py)
and with torch's ops (F.gelu(approximate="tanh"); F.silu(gate) * up), the two alternating within
each round, on torch's threads (one by default: a rank of a 2-rank job on 2 cores). Reports median
milliseconds with their spread, the speedup, and the largest difference between the two ways'
outputs and gradients.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from paired_ops import host_against_torch, machine_line, require_host_kernels

from polytrain.backend import host_activations

CASES = "gelu_tanh:2048,768;gelu_tanh:2048,3072;silu_mul:2048,512;silu_mul:2048,2048"
"""A micro-batch of 8 x 256 tokens: GPT-2 small's FFN at tp 2 (1,536 / 2) and GPT-2 124m's (3,072);
llama tiny's (512) and 125m's (2,048) SwiGLU."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=CASES, help="';'-separated activation:tokens,width")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def step(op: str, inputs: list[torch.Tensor], grad: torch.Tensor, host: bool):
    """Forward + backward one way: (ms, output, input gradients)."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    start = time.perf_counter()
    if op == "gelu_tanh":
        out = host_activations.gelu_tanh(leaves[0]) if host else F.gelu(leaves[0], approximate="tanh")
    else:
        out = host_activations.silu_mul(*leaves) if host else F.silu(leaves[0]) * leaves[1]
    out.backward(grad)
    ms = (time.perf_counter() - start) * 1e3
    return ms, out.detach(), *(x.grad for x in leaves)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    require_host_kernels()
    load = os.getloadavg()[0]
    rows = []
    for spec in args.shapes.split(";"):
        op, size = spec.split(":")
        if op not in ("gelu_tanh", "silu_mul"):
            raise SystemExit(f"error: unknown activation {op!r} (gelu_tanh or silu_mul)")
        n, width = (int(x) for x in size.split(","))
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(n + width)
            inputs = [(2 * torch.randn(n, width, generator=gen)).to(dtype) for _ in range(1 if op == "gelu_tanh" else 2)]
            grad = torch.randn(n, width, generator=gen).to(dtype)
            compared = host_against_torch(lambda host: step(op, inputs, grad, host), args.rounds)
            rows.append(f"| {op} | {n}, {width} | {str(dtype).removeprefix('torch.')} | {compared} |")
    print(machine_line(load, args.rounds, "forward + backward, ms"))
    print("| activation | N, F | dtype | torch ops | host operators | speedup | largest difference |\n"
          "| --- | --- | --- | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
