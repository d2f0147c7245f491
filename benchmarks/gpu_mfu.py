"""Training throughput and MFU of llama 1B and 8B shapes on one accelerator, compile off and on.

    python benchmarks/gpu_mfu.py                        # a lent H200 / H100: ~6-9 min, stops itself at --budget-s
    python benchmarks/gpu_mfu.py --json gpu_mfu.json    # also writes every figure as JSON
    python benchmarks/gpu_mfu.py --cpu-smoke            # tiny shapes on the CPU in ~1 min (CI runs this)
    python benchmarks/gpu_mfu.py --cpu --sizes small --seqs 256 --precision fp32 --profile
                                                        # single-process CPU MFU and where the time goes

For each shape, one model (random weights, built on the meta device and materialised on
the device) is trained with polytrain's pieces as the trainer assembles them: llama blocks,
the chunked loss head (no (tokens x vocabulary) logits), bf16 autocast over fp32 weights,
fused AdamW, gradient clipping at 1.0, full activation recomputation where the shape needs
it (8B: its fp32 weights, gradients and AdamW state are 16 bytes x 8.0B = 120 GiB, which
fit an H200's 139 GiB only with recomputed activations; an H100's 80 GB cannot hold them,
so 8B reports out of memory there: shard it over GPUs with `polytrain train --parallel.zero 3`).
Every sequence length runs eagerly first, then `compile_blocks` compiles the blocks and
every length runs again (the first compiled step's extra time is the compile cost).

    tokens/s  = micro-batch x seq x timed steps / their wall time (device synchronized)
    MFU       = tokens/s x F / peak,  F = 6 N + 12 L w T  (PaLM appendix B: N = parameters
                without the embedding table (the tied head counts), L blocks, w = heads x
                head size, T = sequence length; recomputation is not counted)
    peak      = the trainer's: the accelerator's dense datasheet FLOP/s for the dtype of its GEMMs
                (H100 / H200 SXM: 989e12 bf16), or on a CPU and on devices the table lacks the best
                matmul rate measured there over runs (polytrain/backend/peak.py, flops.py); a row
                faster than a measured peak raises it, so MFU never exceeds 1 (polytrain/train/mfu.py)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from polytrain.backend import get_accelerator
from polytrain.config import TrainConfig, load_config
from polytrain.distributed.activation_checkpoint import apply_activation_checkpointing
from polytrain.models import ARCHITECTURES
from polytrain.optim.builder import build_optimizer
from polytrain.train import compiled
from polytrain.train.build import HostPaths
from polytrain.train.chunked_loss import LossHead
from polytrain.train.matmul_fp32 import wanted as wants_fp32_matmuls
from polytrain.train.mfu import MFU, gemm_dtype

# Llama 3.2 1B and Llama 3.1 8B (rope theta 500000, 128K vocabulary), and CI's tiny shape.
SHAPES = {
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
               tie_embeddings=True, rope_theta=500000.0),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
               tie_embeddings=False, rope_theta=500000.0),
    "small": {},  # the llama `small` preset
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512),
}
RECOMPUTE = {"8b": "full"}  # activation checkpointing per shape (the rest: none)
OP_KINDS = [  # profile rows: the first substring found in an op's name decides its kind
    ("attention", ("scaled_dot_product", "flash", "attention")),
    ("matmul", ("mm", "matmul", "linear", "addmm", "bmm")),
    ("optimizer", ("adam", "_foreach", "fused")),
    ("communication", ("all_reduce", "all_gather", "reduce_scatter", "c10d")),
    ("compiled kernels", ("cpp_fused", "triton", "compiled", "inductor")),
    ("norm / softmax / loss", ("norm", "softmax", "logsumexp", "exp", "log", "rsqrt", "gather", "scatter")),
    ("elementwise", ("mul", "add", "sub", "div", "silu", "sigmoid", "neg", "pow", "mean", "sum", "copy",
                     "cat", "where", "clamp", "fill", "zero", "to", "clone", "embedding", "index")),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1b,8b", help="comma list of " + ", ".join(SHAPES))
    p.add_argument("--seqs", help="sequence lengths (default 4096,8192; --cpu-smoke 64,128)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiled: the first compiles)")
    p.add_argument("--compile", default="off,on", help="'off,on', 'off' or 'on'")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the blocks")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="skip what is left once this much wall time has passed (the device is lent for 10 min)")
    p.add_argument("--profile", action="store_true", help="also time one step by op kind (torch.profiler)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if an accelerator is present")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="CI mode: tiny shape, seq 64 and 128, fp32, 1 warmup + 2 steps, on the CPU")
    p.add_argument("--json", type=Path, help="write every figure here as JSON")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.cpu, args.sizes, args.precision = True, "tiny", "fp32"
        args.steps, args.warmup, args.micro_batch = 2, 1, 2
    args.seqs = args.seqs or ("64,128" if args.cpu_smoke else "4096,8192")
    return args


def build(size: str, acc, device: torch.device, seq: int, precision: str):
    """A llama of `size` on `device` with the chunked loss head and fused AdamW, its layers on the
    paths the trainer picks for `precision` there (on a CPU: the host attention kernel, oneDNN or
    fp32 products; none on GPUs); random N(0, 0.02) weights."""
    overrides = ["--model.size", "small"] if size == "small" else [
        arg for k, v in SHAPES[size].items() for arg in (f"--model.{k}", str(v).lower())]
    cfg = load_config(None, overrides + ["--model.max_seq_len", str(seq), "--data.seq_len", str(seq),
                                         "--train.precision", precision])
    with torch.device("meta"):
        model = ARCHITECTURES["llama"].build(cfg.model)
    model.output = LossHead.replacing(model.output)
    HostPaths.chosen(cfg, model, device, None).apply(model)
    apply_activation_checkpointing(model, RECOMPUTE.get(size, "none"))
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    model.init_buffers()
    return model, build_optimizer(model, TrainConfig()), cfg


def step(model, optimizer, acc, dtype, tokens, targets) -> torch.Tensor:
    """One optimizer step on one micro-batch: tokens, targets (B, T)."""
    with acc.autocast(dtype), model.output.scoring(targets):
        loss = model(tokens)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def measure(model, optimizer, acc, dtype, args, seq: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, vocab, (args.micro_batch, seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    acc.reset_peak_memory()
    acc.synchronize()
    first = None
    for i in range(args.warmup):
        start = time.perf_counter()
        step(model, optimizer, acc, dtype, x, y)
        acc.synchronize()
        first = first if first is not None else time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(model, optimizer, acc, dtype, x, y)
    acc.synchronize()
    elapsed = time.perf_counter() - start
    return {"step_s": elapsed / args.steps, "first_step_s": first, "loss": loss.item(),
            "tokens_per_s": args.micro_batch * seq * args.steps / elapsed,
            "peak_mem_gib": acc.memory_stats()["peak_gb"]}


def profile_by_kind(model, optimizer, acc, dtype, args, seq: int, vocab: int, device) -> list[tuple[str, float]]:
    """Self time of one step's ops, summed by kind (OP_KINDS), as (kind, fraction of the total)."""
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(0, vocab, (args.micro_batch, seq + 1)).to(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(model, optimizer, acc, dtype, tokens[:, :-1], tokens[:, 1:])
        acc.synchronize()
    device_time = device.type != "cpu"
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        t = event.self_device_time_total if device_time else event.self_cpu_time_total
        name = event.key.lower()
        kind = next((k for k, keys in OP_KINDS if any(s in name for s in keys)), "other")
        totals[kind] += t
    whole = sum(totals.values()) or 1.0
    return sorted(((k, t / whole) for k, t in totals.items()), key=lambda kv: -kv[1])


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    began = time.perf_counter()
    acc = get_accelerator()
    if args.cpu:
        from polytrain.backend.cpu import CPUAccelerator

        acc = CPUAccelerator()
    device = acc.device(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    meter = MFU(acc.peak(gemm_dtype(dtype, wants_fp32_matmuls(TrainConfig().matmul_fp32, dtype, device.type))))
    compiled.BACKEND = args.backend
    seqs = [int(s) for s in args.seqs.split(",")]
    modes = [m == "on" for m in args.compile.split(",")]
    rows: list[dict] = []
    print(f"{acc.describe()} | {meter.describe()} | load average {os.getloadavg()[0]:.1f}", flush=True)
    for size in args.sizes.split(","):
        try:
            model, optimizer, cfg = build(size, acc, device, max(seqs), args.precision)
        except torch.OutOfMemoryError:
            rows.append({"size": size, "note": "out of memory building the model"})
            print(f"{size}: out of memory building the model", flush=True)
            continue
        for use_compile in modes:
            if use_compile:
                compiled.compile_blocks(model)
                timer = compiled.CompileTimer.started(len(model.layers))
            for seq in seqs:
                row = {"size": size, "seq": seq, "compile": use_compile, "precision": args.precision,
                       "recompute": RECOMPUTE.get(size, "none"), "params": model.num_params(),
                       "flops_per_token": model.flops_per_token(seq)}
                if time.perf_counter() - began > args.budget_s:
                    row["note"] = f"skipped: past --budget-s {args.budget_s:.0f}"
                else:
                    compiling_before = timer.seconds if use_compile else 0.0
                    try:
                        row.update(measure(model, optimizer, acc, dtype, args, seq, cfg.model.vocab_size, device))
                        row["mfu"], note = meter.of(row["tokens_per_s"] * row["flops_per_token"])
                        if note:
                            print(note, flush=True)
                        if use_compile:
                            row["compile_s"] = timer.seconds - compiling_before
                            row["graph_breaks"] = timer.breaks
                        if args.profile:
                            row["profile"] = profile_by_kind(model, optimizer, acc, dtype, args, seq,
                                                             cfg.model.vocab_size, device)
                    except torch.OutOfMemoryError:
                        row["note"] = "out of memory"
                        optimizer.zero_grad(set_to_none=True)
                rows.append(row)
                print(format_row(row), flush=True)
        del model, optimizer
        if device.type != "cpu":
            getattr(torch, device.type).empty_cache()
    print(report(rows, acc, meter, args, time.perf_counter() - began))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


def format_row(row: dict) -> str:
    what = f"{row['size']} seq {row.get('seq', '-')} compile {'on' if row.get('compile') else 'off'}"
    if "tokens_per_s" not in row:
        return f"{what}: {row.get('note', '')}"
    mfu = f"{row['mfu']:.3f}" if row.get("mfu") is not None else "-"
    return (f"{what}: {row['tokens_per_s']:,.0f} tok/s, step {row['step_s']:.3f} s, MFU {mfu}, "
            f"peak {row['peak_mem_gib']:.1f} GiB, first step {row['first_step_s']:.1f} s, loss {row['loss']:.3f}")


def report(rows: list[dict], acc, meter: MFU, args, wall: float) -> str:
    """The markdown block for benchmarks/RESULTS.md."""
    lines = [f"{datetime.date.today()}, {acc.describe()}, load average {os.getloadavg()[0]:.1f}, {wall:.0f} s.",
             f"`python benchmarks/gpu_mfu.py {' '.join(sys.argv[1:])}`", "",
             "| shape | seq | compile | recompute | tokens/s | step s | MFU | peak GiB | compile s | loss |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['size']} | {r.get('seq', '')} | {'on' if r.get('compile') else 'off'} | | "
                         f"{r.get('note', '')} | | | | | |")
            continue
        mfu = f"{r['mfu']:.3f}" if r.get("mfu") is not None else "-"
        lines.append(f"| {r['size']} | {r['seq']} | {'on' if r['compile'] else 'off'} | {r['recompute']} | "
                     f"{r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {mfu} | {r['peak_mem_gib']:.1f} | "
                     f"{r.get('compile_s', 0):.1f} | {r['loss']:.3f} |")
    by_speed = [r for r in rows if "tokens_per_s" in r]
    for r in by_speed:
        if r.get("profile"):
            kinds = ", ".join(f"{k} {f:.0%}" for k, f in r["profile"])
            lines.append(f"\nprofile {r['size']} seq {r['seq']} compile {'on' if r['compile'] else 'off'}: {kinds}")
    lines.append(f"\n{meter.describe()}; F = 6N + 12 L w T per token")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
