"""The attention core's forward and backward in 16 bits against the same in fp32 (train.attention_fp32).

    python benchmarks/attention_precision.py                 # llama tiny / small / 125m heads, seq 256 and 1024
    python benchmarks/attention_precision.py --rounds 1 --shapes 2,2,64,16   # a quick check it runs

For each (batch, heads, seq, head_dim), causal: F.scaled_dot_product_attention on bf16 q, k, v
(what a bf16 block runs), and `polytrain.train.attention_fp32.in_fp32` of it (q, k, v upcast,
the output cast back to bf16), forward then backward of a fixed gradient, alternating within
each round on torch's threads. Reports milliseconds (median and spread over rounds) of the
forward and of forward + backward, the speedup of the fp32 way, and each way's largest error
against a float64 reference of the same inputs.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from polytrain.train.attention_fp32 import in_fp32

SHAPES = "8,6,256,32;8,6,256,64;8,12,256,64;2,6,1024,64;2,12,1024,64"
"""llama tiny (6 heads of 32) and small (6 of 64) at micro-batch 8 x seq 256; 125m (12 of 64); seq 1024."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="';'-separated batch,heads,seq,head_dim")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    return p.parse_args()


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def exact(q, k, v) -> torch.Tensor:
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    args = parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    load = os.getloadavg()[0]
    lines = []
    for spec in args.shapes.split(";"):
        b, h, t, d = (int(n) for n in spec.split(","))
        gen = torch.Generator().manual_seed(b * h + t * d)
        q, k, v = (torch.randn(b, h, t, d, generator=gen).to(dtype).requires_grad_() for _ in range(3))
        grad = torch.randn(b, h, t, d, generator=gen).to(dtype)
        ways = {args.dtype: sdpa, "fp32": in_fp32(sdpa)}
        reference = exact(q, k, v)
        errors = {name: (core(q, k, v, None).double() - reference).abs().max().item() for name, core in ways.items()}

        def forward(core):
            with torch.no_grad():
                core(q, k, v, None)

        def step(core):
            core(q, k, v, None).backward(grad)

        times = {(name, part): [] for name in ways for part in ("fwd", "step")}
        for core in ways.values():  # warm up
            step(core)
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                times[name, "fwd"].append(timed_ms(lambda: forward(ways[name])))
                times[name, "step"].append(timed_ms(lambda: step(ways[name])))
        med = {key: statistics.median(v) for key, v in times.items()}
        cells = " | ".join(f"{med[key]:.2f} ({min(v):.2f}-{max(v):.2f})" for key, v in times.items())
        speedup = med[args.dtype, "step"] / med["fp32", "step"]
        lines.append(f"| {b}, {h}, {t}, {d} | {cells} | {speedup:.2f}x | "
                     f"{errors[args.dtype]:.2e} / {errors['fp32']:.2e} |")
    print(f"\n{datetime.date.today()}, {torch.get_num_threads()} threads, torch {torch.__version__}, load average "
          f"{load:.1f} at start, {os.getloadavg()[0]:.1f} at the end; causal, median (spread) of {args.rounds} "
          "rounds, ms\n")
    print(f"| B, H, T, D | {args.dtype} forward | {args.dtype} forward + backward | fp32 forward | "
          f"fp32 forward + backward | fp32 speedup (fwd + bwd) | max error {args.dtype} / fp32 |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
