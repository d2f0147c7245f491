"""Context parallelism and long-sequence attention: bytes, speed and memory.

    python benchmarks/context_parallel.py bytes      # ~2 min: 4 gloo ranks, every mode at cp 2 and 4
    python benchmarks/context_parallel.py kernel     # ~10 min: blockwise vs SDPA, 4K-32K tokens, one process
    python benchmarks/context_parallel.py longest    # ~10 min: longest sequence under a per-rank memory cap
    python benchmarks/context_parallel.py all --json cp.json

bytes: one attention layer (B 1, T --seq-len, H 8 query and 2 key/value heads of 64, fp32)
    per layout on 4 gloo ranks (cp 2 runs as two independent groups). Bytes each rank sends,
    counted twice: polytrain's tally (collectives.comm_stats) and, independently, every
    torch.distributed call wrapped at the c10d level (zero_memory_comm.CommCounter), each
    over the analytic formula of context_parallel/cost.py (1.00 = exact). Also the median
    seconds of a forward + backward and the tokens/s that makes, per mode at equal degree,
    and DeepSpeed's Ulysses layer (deepspeed.sequence.layer.DistributedAttention around
    SDPA, its key/value heads repeated to the 4 it requires) on the same shapes where it runs.
kernel: blockwise attention (models/common/blockwise_attention.py) against
    F.scaled_dot_product_attention at 4K-32K tokens (B 1, H 4, D 32; one thread), causal,
    and with packed documents (SDPA then needs its (T, T) mask): median seconds of forward +
    backward and the peak resident memory the step adds, each way in a fresh process.
longest: a 2-block Llama (dim 128, 4 heads) trained one step (forward, chunked loss,
    backward) at doubling sequence lengths with cp 1, 2, 4 (ring): the longest that keeps
    every rank's added peak memory under --cap-mib, and that memory.

Peak memory is VmHWM from /proc/self/status, reset before the step (Linux only), in processes
started with MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns every freed large block to the
system and the high-water mark follows the tensors alive, not the heap's history.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests / benchmarks are not installed
from benchmarks.zero_memory_comm import CommCounter
from polytrain.backend.flops import cpu_model
from tests.multirank import run_ranks

MiB = 2**20
LAYOUTS = {"ring2": ([[0, 1], [2, 3]], 1), "ulysses2": ([[0, 1], [2, 3]], 2),
           "ring4": ([[0, 1, 2, 3]], 1), "ulysses4": ([[0, 1, 2, 3]], 4), "hybrid2x2": ([[0, 1, 2, 3]], 2)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("bytes", "kernel", "longest", "all"))
    p.add_argument("--seq-len", type=int, default=4096, help="bytes: tokens of the whole sequence")
    p.add_argument("--reps", type=int, default=5, help="timed forward + backward runs per case (bytes: alternating rounds)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768], help="kernel")
    p.add_argument("--sdpa-max-gib", type=float, default=3.0,
                   help="kernel: skip SDPA with a dense mask where its (T, T) tensors would pass this")
    p.add_argument("--cap-mib", type=float, default=256.0, help="longest: per-rank memory cap")
    p.add_argument("--max-len", type=int, default=65536, help="longest: stop doubling here")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    return p.parse_args()


def _peak_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


# ----- bytes and modes -----------------------------------------------------------------------


def _bytes_body(rank: int, world: int, seq_len: int, reps: int) -> dict:
    import torch.distributed as dist

    from polytrain.distributed.collectives import comm_stats
    from polytrain.distributed.context_parallel import ContextParallel, new_cp_groups
    from polytrain.distributed.context_parallel.cost import attention_bytes

    B, H, Hkv, D = 1, 8, 2, 64
    out, steps = {}, {}
    for name, (groups, ulysses) in LAYOUTS.items():
        cp = ContextParallel(new_cp_groups(groups, ulysses))
        t = seq_len // cp.groups.size
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(B, h, t, D, generator=g, requires_grad=True) for h in (H, Hkv, Hkv))

        def step(cp=cp, q=q, k=k, v=v):
            cp.attention(q, k, v, causal=True).sum().backward()

        with comm_stats() as ours, CommCounter() as c10d:
            step()  # also the warm-up of the timing below
        fwd, bwd = attention_bytes(B, seq_len, H, Hkv, D, cp.groups.ring_size, cp.groups.ulysses_size, 4)
        out[name] = {"bytes": ours.total_bytes, "c10d_bytes": sum(b for _, b in c10d.calls.values()),
                     "formula": fwd + bwd}
        steps[name] = step
    ds_step = _deepspeed_ulysses(seq_len)
    if isinstance(ds_step, str):
        out["deepspeed_ulysses4"] = {"error": ds_step}
    else:
        steps["deepspeed_ulysses4"] = ds_step
        ds_step()  # warm-up
    # Alternating rounds, the order rotating, every rank starting each step together.
    names, times = list(steps), {name: [] for name in steps}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        out.setdefault(name, {}).update(seconds=statistics.median(ts), spread=(min(ts), max(ts)),
                                        tokens_per_s=seq_len / statistics.median(ts))
    return out


def _deepspeed_ulysses(seq_len: int):
    """DeepSpeed's Ulysses layer over SDPA, 4 ranks, the same shapes (its layout: (T/P, B, H, D)):
    a forward + backward step to time, or why it cannot run."""
    try:
        import deepspeed
        import torch.distributed as dist
        import torch.nn.functional as F
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="gloo")

        def local(q, k, v, *args, **kwargs):  # (T, B, H/P, D) -> the same
            q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)

        layer = DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=0)
        t = seq_len // dist.get_world_size()
        # It needs a key/value head per rank: the 2 heads repeated to 4, as polytrain does inside.
        q, k, v = (torch.randn(t, 1, h, 64, requires_grad=True) for h in (8, 4, 4))
        return lambda: layer(q, k, v, 1).sum().backward()
    except Exception as e:  # report why, keep the other figures
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def run_bytes(args) -> dict:
    per_rank = run_ranks(4, _bytes_body, args.seq_len, args.reps)
    print(f"one attention layer, causal, B 1, T {args.seq_len}, 8 query / 2 KV heads of 64, fp32, 4 gloo ranks")
    print(f"{args.reps} alternating rounds; seconds of a forward + backward: median over rounds and ranks "
          "(spread: fastest to slowest step of any rank)")
    print(f"{'layout':>10} {'bytes/rank':>12} {'formula':>12} {'ours/f':>7} {'c10d/f':>7} {'s/step':>7} "
          f"{'spread':>13} {'tok/s':>8}")
    table = {}
    for name in LAYOUTS:
        rows = [r[name] for r in per_rank]
        sent = max(r["bytes"] for r in rows)
        row = {"bytes": sent, "formula": rows[0]["formula"],
               "ratio": max(r["bytes"] / r["formula"] for r in rows),
               "c10d_ratio": max(r["c10d_bytes"] / r["formula"] for r in rows),
               "seconds": statistics.median(r["seconds"] for r in rows),
               "spread": (min(r["spread"][0] for r in rows), max(r["spread"][1] for r in rows))}
        row["tokens_per_s"] = args.seq_len / row["seconds"] * (2 if name.endswith("2") else 1)  # two groups
        table[name] = row
        print(f"{name:>10} {sent:>12,.0f} {row['formula']:>12,.0f} {row['ratio']:>7.3f} {row['c10d_ratio']:>7.3f} "
              f"{row['seconds']:>7.3f} {row['spread'][0]:>6.3f}-{row['spread'][1]:<6.3f} {row['tokens_per_s']:>8,.0f}")
    ds = per_rank[0]["deepspeed_ulysses4"]
    if "error" in ds:
        print(f"DeepSpeed Ulysses: did not run ({ds['error']})")
    else:
        ds["seconds"] = statistics.median(r["deepspeed_ulysses4"]["seconds"] for r in per_rank)
        ds["tokens_per_s"] = args.seq_len / ds["seconds"]
        print(f"DeepSpeed Ulysses (4 ranks, SDPA inside): {ds['seconds']:.3f} s/step, {ds['tokens_per_s']:,.0f} tok/s "
              f"(polytrain's Ulysses at 4 / DeepSpeed's: {ds['seconds'] / table['ulysses4']['seconds']:.2f}x tokens/s)")
    table["deepspeed_ulysses4"] = ds
    return table


# ----- kernel: blockwise vs SDPA ------------------------------------------------------------


def measure_kernel(T: int, way: str, packed: bool, reps: int) -> dict:
    """One case in this process: median seconds of forward + backward and the peak RSS it adds (MiB)."""
    import torch.nn.functional as F

    from polytrain.models.common.blockwise_attention import Visibility, blockwise_attention

    torch.set_num_threads(1)
    B, H, D = 1, 4, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=True) for _ in range(3))
    docs = (torch.arange(T) // 2048)[None] if packed else None  # documents of 2K tokens

    def step():
        if way == "blockwise":
            out = blockwise_attention(q, k, v, Visibility.of_sequence(T, T, True, q.device, docs))
        elif docs is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.sum().backward()

    step()
    base = _rss_mib("VmRSS")
    _peak_reset()
    seconds = [0.0] * reps
    for i in range(reps):
        start = time.perf_counter()
        step()
        seconds[i] = time.perf_counter() - start
    return {"seconds": statistics.median(seconds), "peak_mib": _rss_mib("VmHWM") - base}


def run_kernel(args) -> dict:
    print("attention forward + backward, B 1, H 4, D 32, fp32, one thread; packed = documents of 2,048 tokens")
    print(f"{'T':>6} {'masks':>7} {'way':>10} {'seconds':>8} {'peak MiB':>9}")
    table = {}
    for T in args.lengths:
        for packed in (False, True):
            for way in ("sdpa", "blockwise"):
                dense_gib = T * T * (1 + 3 * 4 * 4) / 2**30  # bool mask + fp32 weights, grads, softmax, 4 heads
                if way == "sdpa" and packed and dense_gib > args.sdpa_max_gib:
                    table[f"{T}/packed/sdpa"] = {"skipped": f"needs ~{dense_gib:.0f} GiB for its (T, T) tensors"}
                    print(f"{T:>6}  packed       sdpa  skipped: needs ~{dense_gib:.0f} GiB for its (T, T) tensors")
                    continue
                cmd = [sys.executable, __file__, "_kernel", str(T), way, str(int(packed)), str(args.reps)]
                run = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
                key = f"{T}/{'packed' if packed else 'causal'}/{way}"
                if run.returncode != 0:
                    table[key] = {"error": (run.stderr.strip().splitlines() or ["killed"])[-1]}
                    print(f"{T:>6} {'packed' if packed else 'causal':>7} {way:>10}  failed: {table[key]['error']}")
                    continue
                table[key] = json.loads(run.stdout.strip().splitlines()[-1])
                print(f"{T:>6} {'packed' if packed else 'causal':>7} {way:>10} {table[key]['seconds']:>8.2f} "
                      f"{table[key]['peak_mib']:>9.0f}")
    return table


# ----- longest sequence under a memory cap ---------------------------------------------------


def _longest_body(rank: int, world: int, cp_size: int, seq_len: int) -> dict:
    from polytrain.config import ModelConfig
    from polytrain.distributed.context_parallel import ContextParallel, new_cp_groups
    from polytrain.models.common.init import init_plain
    from polytrain.models.llama.model import Llama
    from polytrain.train.chunked_loss import linear_cross_entropy

    cfg = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=384, vocab_size=4096,
                      max_seq_len=seq_len)
    model = Llama(cfg)
    init_plain(model, 0)
    head, model.output = model.output, None  # hidden states out; the loss projects them chunk by chunk
    cp = ContextParallel(new_cp_groups([list(range(cp_size))], 1)) if cp_size > 1 else None
    if cp is not None:
        cp.apply(model)
    else:
        from polytrain.models.common.blockwise_attention import blockwise_core

        for block in model.layers.values():
            block.attention.core = lambda q, k, v, mask: blockwise_core(q, k, v, mask, causal=True, scale=None)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq_len)
    if cp is not None:
        inputs, targets, positions = cp.shard(inputs), cp.shard(targets), cp.shard(positions, dim=0)
    base = _rss_mib("VmRSS")
    _peak_reset()
    start = time.perf_counter()
    hidden = model(inputs, positions=positions)
    linear_cross_entropy(hidden.flatten(0, 1), head.weight, None, targets.flatten()).backward()
    return {"peak_mib": _rss_mib("VmHWM") - base, "seconds": time.perf_counter() - start}


def run_longest(args) -> dict:
    print(f"2-block Llama (dim 128), one training step, ring cp; per-rank cap {args.cap_mib:.0f} MiB")
    print(f"{'cp':>3} {'seq_len':>8} {'peak MiB/rank':>14} {'seconds':>8}")
    table = {}
    for cp_size in (1, 2, 4):
        seq_len, best = 2048, None
        while seq_len <= args.max_len:
            rows = run_ranks(cp_size, _longest_body, cp_size, seq_len, timeout=3600)
            peak = max(r["peak_mib"] for r in rows)
            print(f"{cp_size:>3} {seq_len:>8} {peak:>14.0f} {rows[0]['seconds']:>8.1f}")
            if peak > args.cap_mib:
                break
            best = {"seq_len": seq_len, "peak_mib": peak, "seconds": rows[0]["seconds"]}
            seq_len *= 2
        table[str(cp_size)] = best
        print(f"cp {cp_size}: longest under the cap {best['seq_len'] if best else 'none'}")
    return table


def main() -> None:
    if sys.argv[1:2] == ["_kernel"]:  # one kernel case in a fresh process
        T, way, packed, reps = sys.argv[2:6]
        print(json.dumps(measure_kernel(int(T), way, bool(int(packed)), int(reps))))
        return
    args = parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # for the processes started below (module docstring)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f}; timings are not trustworthy on a busy machine")
    parts = ("bytes", "kernel", "longest") if args.part == "all" else (args.part,)
    results = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(),
               "nproc": os.cpu_count(), "load": load}
    runners = {"bytes": run_bytes, "kernel": run_kernel, "longest": run_longest}
    for part in parts:
        results[part] = runners[part](args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
