"""Decoding's attention: polytrain's host kernel against SDPA and the compiled products and sums.

    python benchmarks/decode_attention.py                      # llama 125m's heads, bf16, batch 1 and 8
    python benchmarks/decode_attention.py --dtype fp32
    python benchmarks/decode_attention.py --rounds 1 --calls 5 --cases 1:16:9   # a quick check it runs

One decoding step's attention of one layer: q (B, Hkv, G, D) against a static cache's k and v
(B, Hkv, S, D) of which the first `written` slots are unmasked, as a compiled decoding step sees it.
Three ways, alternating in each round:

    kernel         backend.host_attention.decode_attention (host_attention.cpp)
    SDPA           F.scaled_dot_product_attention with the boolean mask (eager decoding's way)
    compiled sums  models.common.attention.attention_as_sums under torch.compile (Inductor), the
                   compiled host step's way before the kernel

Reported per case (B:S:written): microseconds per call (median and spread over rounds), the
kernel's speedup over each, and its largest difference from float64 attention relative to the
output's largest value.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.nn.functional as F

from polytrain.backend import host_attention, host_matmul
from polytrain.models.common.attention import attention_as_sums


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1:96:64,8:96:64,1:1024:512,8:1024:512,8:2048:1900",
                   help="comma list of batch:slots:written")
    p.add_argument("--heads", default="4:3:64", help="kv heads : query heads per kv head : head dim")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=50, help="calls timed together in a round")
    return p.parse_args()


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    args = parse_args()
    if not host_matmul.available():
        raise SystemExit("the host kernels could not be built here (see the warning above)")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    hkv, group, dim = (int(n) for n in args.heads.split(":"))
    sums = torch.compile(attention_as_sums, backend="inductor", dynamic=False)
    load = os.getloadavg()[0]
    gen = torch.Generator().manual_seed(0)
    lines = []
    for case in args.cases.split(","):
        batch, slots, written = (int(n) for n in case.split(":"))
        q = torch.randn(batch, hkv, group, dim, generator=gen).to(dtype)
        k, v = (torch.randn(batch, hkv, slots, dim, generator=gen).to(dtype) for _ in range(2))
        mask = (torch.arange(slots) < written)[None, None, None, :].expand(batch, 1, 1, slots).contiguous()
        scale = dim ** -0.5
        ways = {"kernel": lambda: host_attention.decode_attention(q, k, v, mask, scale),
                "SDPA": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
                "compiled sums": lambda: sums(q, k, v, mask, scale)}
        for fn in ways.values():  # compiles, and warms the caches
            fn()
            fn()
        times = {name: [] for name in ways}
        for r in range(args.rounds):
            names = list(ways)[r % len(ways):] + list(ways)[:r % len(ways)]
            for name in names:
                times[name].append(per_call_us(ways[name], args.calls))
        med = {name: statistics.median(t) for name, t in times.items()}
        exact = attention_as_sums(q.double(), k.double(), v.double(), mask, scale)
        diff = (ways["kernel"]().double() - exact).abs().max() / exact.abs().max()
        cells = " | ".join(f"{med[n]:,.0f} ({min(t):,.0f}-{max(t):,.0f})" for n, t in times.items())
        lines.append(f"| {batch} | {slots} | {written} | {cells} | {med['SDPA'] / med['kernel']:.2f}x | "
                     f"{med['compiled sums'] / med['kernel']:.2f}x | {diff:.1e} |")
    print(f"\n{datetime.date.today()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.dtype}, "
          f"{hkv} kv heads x {group} query heads x {dim}; load average {load:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at the end; median (spread) of {args.rounds} rounds of {args.calls} calls\n")
    print("| batch | slots | written | kernel us | SDPA us | compiled sums us | SDPA / kernel | "
          "compiled sums / kernel | kernel's largest difference |\n"
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
