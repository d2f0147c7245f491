"""The host CPU's flash-attention kernel against torch's SDPA, a training step's core (train.host_attention).

    python benchmarks/host_flash_attention.py                   # llama tiny / small / 125m heads, 256-2048 tokens
    python benchmarks/host_flash_attention.py --threads 1       # one core, as each of 2 ranks on 2 cores
    python benchmarks/host_flash_attention.py --rounds 1 --shapes 1,2,2,64,16   # a quick check it runs

For each (batch, query heads, key/value heads, seq, head_dim), causal, a training step's
attention core, forward then backward of a fixed gradient, in the three ways a polytrain block
can run it:
- fp32 training: SDPA on fp32 q, k, v (k and v repeated to the query heads, as the model's core
  does) against the kernel (grouped heads read in place);
- bf16 training: SDPA on bf16 q, k, v; SDPA on fp32 copies of them with the output cast back
  (train.attention_fp32); the kernel on the bf16 tensors (fp32 sums inside).
The ways alternate within each round (the order reversed every other round). Reports the median
milliseconds of forward + backward with their spread over the rounds, the kernel's speedup over
each, and each way's largest output error against a float64 reference of the same inputs.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from paired_ops import alternate, cell, machine_line, require_host_kernels, speedup

from polytrain.backend import host_flash_attention
from polytrain.train.attention_fp32 import in_fp32

SHAPES = "8,6,2,256,32;8,6,2,256,64;4,12,4,512,64;2,12,4,1024,64;1,12,4,2048,64"
"""llama tiny (6 query heads of 32 over 2 kv heads) and small (6 of 64) at micro-batch 8 x seq
256; 125m's heads (12 of 64 over 4) at 512-2048 tokens."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="';'-separated batch,heads,kv_heads,seq,head_dim")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args()


def sdpa(q, k, v, mask):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def kernel(q, k, v, mask):
    return host_flash_attention.flash_attention(q, k, v, causal=True)


def exact(q, k, v) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, T, T)
    future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def step_ms(core, q, k, v, grad) -> float:
    start = time.perf_counter()
    core(q, k, v, None).backward(grad)
    return (time.perf_counter() - start) * 1e3


def measure(spec: str, rounds: int) -> list[str]:
    b, h, hkv, t, d = (int(n) for n in spec.split(","))
    gen = torch.Generator().manual_seed(b * h + t * d)
    # q as the model makes it: (B, T, H, D) projections seen as (B, H, T, D)
    base = (torch.randn(b, t, h, d, generator=gen).transpose(1, 2), torch.randn(b, hkv, t, d, generator=gen),
            torch.randn(b, hkv, t, d, generator=gen))
    grad = torch.randn(b, h, t, d, generator=gen)
    rows = []
    for precision, ways in (("fp32", {"SDPA fp32": sdpa, "kernel": kernel}),
                            ("bf16", {"SDPA bf16": sdpa, "SDPA on fp32 copies": in_fp32(sdpa), "kernel": kernel})):
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        q, k, v = (x.to(dtype).requires_grad_() for x in base)
        g = grad.to(dtype)
        reference = exact(q, k, v)
        errors = {name: (core(q, k, v, None).double() - reference).abs().max().item() for name, core in ways.items()}
        for core in ways.values():  # warm up
            step_ms(core, q, k, v, g)
        times = alternate({name: (lambda core=core: step_ms(core, q, k, v, g)) for name, core in ways.items()}, rounds)
        for name, ts in times.items():
            ratio = "" if name == "kernel" else speedup(ts, times["kernel"])
            rows.append(f"| {b}, {h}, {hkv}, {t}, {d} | {precision} | {name} | {cell(ts)} | {ratio} | {errors[name]:.1e} |")
    return rows


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    require_host_kernels()
    load = os.getloadavg()[0]
    rows = [row for spec in args.shapes.split(";") for row in measure(spec, args.rounds)]
    print(machine_line(load, args.rounds, "causal, forward + backward"))
    print("| B, H, Hkv, T, D | training in | way | ms | kernel's speedup over it | max output error |\n"
          "| --- | --- | --- | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
