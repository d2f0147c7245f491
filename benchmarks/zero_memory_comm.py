"""ZeRO stages 0-3: model-state bytes and communication per rank, measured, against theory.

    python benchmarks/zero_memory_comm.py                   # ~5-10 min on 2 cores: nproc 2 and 4, bf16
    python benchmarks/zero_memory_comm.py --size tiny --nproc 2 --zero 2   # ~1 min check that it runs
    python benchmarks/zero_memory_comm.py --precision fp32  # fp32 model states (the earlier table)
    python benchmarks/zero_memory_comm.py --json zero.json  # also writes every figure as JSON

For each nproc, one set of gloo ranks builds `Trainer(cfg)` for `parallel.zero` 0, 1, 2, 3 in
turn (--precision bf16: 16-bit weights and gradients, fp32 masters; AdamW; --accum
micro-batches per step) and runs two `train_step()`s; the second is measured. Then, with
DeepSpeed installed (DS_ACCELERATOR=cpu, as for vs_deepspeed.py), the same ranks train the
same model with DeepSpeed's engine at each stage, measured the same way.

1. Model-state bytes on each rank: the bytes of every live tensor storage (found by the
   garbage collector, each storage counted once), taken when each micro-batch's backward
   and its reductions are done and right before the optimizer step; the peak over the
   step. Activations are freed at those points, so what is left is parameters, gradients,
   master weights and optimizer state (and a few KiB of buffers), whoever allocated them:
   the same count for polytrain and DeepSpeed. polytrain's share of it by kind (compute
   parameters, masters, gradients, optimizer state) is taken at the optimizer step.
   Theory: `THEORY`, the ZeRO paper's mixed-precision figures in bf16.
2. Bytes each rank sends during the whole step (polytrain), counted by wrapping the
   torch.distributed collectives, as a ring algorithm moves them, against what the
   implementation should send (`expected_comm`). Collectives of under 4 KiB (the loss
   average, the gradient norm) are reported apart.
3. A markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Self

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed.tensor import DTensor

from polytrain.backend import host_collectives
from polytrain.distributed.reduce_scatter import buffers_sent

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.multirank is not installed
from tests.multirank import run_ranks

MiB = 2**20
SMALL_COLLECTIVE = 4096  # bytes; smaller collectives are bookkeeping (loss, grad norm)

# psi = parameter count, N = data-parallel ranks; bytes per rank with AdamW.
# bf16 (16-bit model states): the ZeRO paper's mixed-precision figures (Rajbhandari et al.
# 2020, Fig. 1): 2 psi of 16-bit params + 2 psi of 16-bit grads + K psi of optimizer state,
# K = 12 (fp32 master + exp_avg + exp_avg_sq), sharded as each stage shards them.
# fp32: params and grads are 4 psi each; FSDP2 (zero 0 and 3) steps the parameters
# themselves (K = 8), polytrain's ZeRO-1/2 keep a separate fp32 master shard next to the
# replicated compute parameters, so there K = 12.
THEORY = {
    "bf16": {
        0: ("16psi", lambda n: 2 + 2 + 12),
        1: ("4psi+12psi/N", lambda n: 2 + 2 + 12 / n),
        2: ("2psi+14psi/N", lambda n: 2 + (2 + 12) / n),
        3: ("16psi/N", lambda n: (2 + 2 + 12) / n),
    },
    "fp32": {
        0: ("16psi", lambda n: 4 + 4 + 8),
        1: ("8psi+12psi/N", lambda n: 4 + 4 + 12 / n),
        2: ("4psi+16psi/N", lambda n: 4 + (4 + 12) / n),
        3: ("16psi/N", lambda n: (4 + 4 + 8) / n),
    },
}


def expected_comm(zero: int, n: int, accum: int, psi: int, psi_kept: int, gather_bytes: int,
                  reduce_psi: int) -> float:
    """Bytes one rank should send per step (ring algorithms), as polytrain implements each stage.

    Gradients are reduced in fp32 (4 bytes), `reduce_psi` psi-sized buffers per reduction
    (2 where the reduce-scatter is done as an all-reduce, else 1); parameters are gathered
    in `gather_bytes` (2 for 16-bit weights). zero 0 all-reduces once per step, ZeRO-1
    reduces once and gathers once, ZeRO-2 reduces every micro-batch, ZeRO-3 gathers every
    unit in forward and, except the `psi_kept` parameters of the units kept gathered into
    backward (the root and the last block), again in backward, and reduces, per micro-batch.
    """
    share = (n - 1) / n
    if zero == 0:
        return 2 * psi * share * 4
    reductions = {1: 1, 2: accum, 3: accum}[zero]
    reduced = reductions * reduce_psi * psi * share * 4
    gathered = (accum * (2 * psi - psi_kept) if zero == 3 else psi) * share * gather_bytes
    return reduced + gathered


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small",
                   help="model size preset (big enough that model state dwarfs the rest)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="reduce bucket of both frameworks (polytrain's and DeepSpeed's default size)")
    p.add_argument("--accum", type=int, default=2,
                   help="micro-batches per step (ZeRO-1 holds whole gradients between them)")
    p.add_argument("--deepspeed", choices=("auto", "yes", "no"), default="auto",
                   help="also measure DeepSpeed on the same model (auto: if it is installed)")
    p.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--source", default="stdlib",
                   help="data.source (the first stdlib call tokenizes, ~30 s)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    return p.parse_args()


# ----- communication ------------------------------------------------------------------

# Collective -> (argument holding the buffer, how that buffer relates to what one of N ranks
# sends in a ring): "all_reduce" sends 2(N-1)/N of it (reduce-scatter, then all-gather);
# "whole" is the full-size buffer of an all-gather / reduce-scatter / broadcast, (N-1)/N of
# it is sent; "piece" is one rank's piece of an all-gather, sent N-1 times.
C10D = {
    "all_reduce": ("tensor", "all_reduce"),
    "broadcast": ("tensor", "whole"),
    "all_gather_single": ("output_tensor", "whole"),
    "all_gather_into_tensor": ("output_tensor", "whole"),
    "_all_gather_base": ("output_tensor", "whole"),
    "all_gather": ("tensor", "piece"),
    "reduce_scatter_single": ("input", "whole"),
    "reduce_scatter_tensor": ("input", "whole"),
    "_reduce_scatter_base": ("input", "whole"),
    "reduce_scatter": ("input_list", "whole"),
    "all_to_all_single": ("input", "whole"),
    "send": ("tensor", "p2p"),
    "isend": ("tensor", "p2p"),
}
# DTensor redistributes (e.g. the ZeRO-3 gradient norm) through functional collectives.
FUNCOL = {
    "all_reduce": ("self", "all_reduce"),
    "broadcast": ("self", "whole"),
    "all_gather_single": ("self", "piece"),
    "reduce_scatter_single": ("self", "whole"),
}
HOST = {  # polytrain's shared-memory path (backend/host_collectives.py): counted when it ran
    "all_reduce_": ("x", "all_reduce"),
    "reduce_scatter_": ("x", "whole"),
    "all_to_all_": ("x", "whole"),
    "all_gather_": ("out", "whole"),
}
SENT_SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n,
              "whole": lambda n: (n - 1) / n,
              "piece": lambda n: n - 1,
              "p2p": lambda n: 1}


def _nbytes(buffer) -> int:
    buffers = buffer if isinstance(buffer, (list, tuple)) else [buffer]
    return sum(t.numel() * t.element_size() for t in buffers)


def _funcol_size(group) -> int:
    return c10d._resolve_process_group(funcol._resolve_group_name(group)).size()


class CommCounter:
    """Within `with`, count what this rank sends in every collective: {name: [calls, bytes]}.

    Patches the module attributes callers look up at call time: FSDP2 calls
    `dist.all_gather_single` / `dist.reduce_scatter_single` / `dist.all_reduce`
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), polytrain's ZeRO-1/2 the
    same through `dist`, DTensor `funcol.*`. Deprecated aliases (all_gather_into_tensor, ...)
    call all_gather_single inside c10d, so only the outermost call counts.
    """

    def __init__(self):
        self.calls: dict[str, list] = {}  # "op (kind)" -> [calls, bytes sent]
        self._depth = 0
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, module, name: str, buffer_arg: str, share: str, group_size, label: str,
              ran=lambda result: True) -> None:
        """`ran(result)`: whether the call did the collective (the shared-memory path may decline)."""
        original = getattr(module, name)
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            outermost = self._depth == 0
            self._depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
            if outermost and ran(result):
                bound = signature.bind(*args, **kwargs)
                n = group_size(bound.arguments.get("group"))
                nbytes = _nbytes(bound.arguments[buffer_arg])
                kind = "small" if nbytes < SMALL_COLLECTIVE else "model"
                entry = self.calls.setdefault(f"{label} ({kind})", [0, 0])
                entry[0] += 1
                entry[1] += SENT_SHARE[share](n) * nbytes
            return result

        self._saved.append((module, name, original))
        setattr(module, name, counted)

    def __enter__(self) -> Self:
        for name, (arg, share) in C10D.items():
            for module in (dist, c10d):  # the same functions under two names; callers use either
                if hasattr(module, name):
                    self._wrap(module, name, arg, share, lambda g: dist.get_world_size(g), name)
        for name, (arg, share) in FUNCOL.items():
            self._wrap(funcol, name, arg, share, _funcol_size, f"funcol.{name}")
        for name, (arg, share) in HOST.items():
            self._wrap(host_collectives, name, arg, share, lambda g: dist.get_world_size(g), f"shm.{name}", bool)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)

    def total(self, kind: str) -> int:
        return int(sum(b for key, (_, b) in self.calls.items() if key.endswith(f"({kind})")))


# ----- memory -------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def model_state_bytes(trainer) -> dict[str, int]:
    """Bytes of the storages behind params, fp32 masters, gradients and optimizer state (polytrain).

    By storage, not by tensor: views (ZeRO-1/2's per-parameter masters and gradients
    view flat bucket buffers, FSDP2's shards view padded buffers) count once, padding included.
    """
    seen: set[int] = set()

    def add(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(trainer.model.parameters())
    buckets = getattr(trainer.dp, "buckets", [])  # ZeRO-1/2 only
    state = trainer.optimizer.state.values()
    return {
        "params": add(params),
        "masters": add(b.master for b in buckets),
        "grads": add([p.grad for p in params] + [b.grad for b in buckets]),
        "optimizer": add(v for s in state for v in s.values() if isinstance(v, torch.Tensor)),
    }


def live_tensor_bytes() -> int:
    """Bytes of every storage a live tensor holds in this process, each storage once.

    Through the garbage collector, so it sees whatever any framework allocated (tensor
    attributes, flat buffers, optimizer state), not only what one of them exposes, plus
    the gradients of the leaf tensors found. A DTensor is counted through its local
    tensor; meta tensors hold nothing.
    """
    gc.collect()
    seen: set[int] = set()
    total = 0
    warnings.filterwarnings("ignore")  # probing every object's type trips deprecation warnings

    def add(t: torch.Tensor) -> None:
        nonlocal total
        storage = _local(t).untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta:
            continue
        if not isinstance(obj, DTensor):
            add(obj)
        # Autograd keeps a parameter's .grad in C++: no Python object to find until asked for.
        if obj.requires_grad and obj.is_leaf and obj.grad is not None:
            add(obj.grad)
    return total


class StepProbe:
    """The live tensor bytes after each micro-batch's backward and before the optimizer step."""

    def __init__(self):
        self.points: list[int] = []
        self.on = False

    def __call__(self) -> None:
        if self.on:
            self.points.append(live_tensor_bytes())

    @property
    def peak(self) -> int:
        return max(self.points)


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux)
        f.write("5")


def rss_mib(field: str = "VmHWM") -> float:
    """VmHWM (peak resident set) or VmRSS (now) of this process, in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


# ----- one set of ranks -------------------------------------------------------------------


def _config(zero: int, world_size: int, opts: dict, work: str):
    from polytrain.config import load_config

    return load_config(None, [
        "--model.size", opts["size"], "--data.source", opts["source"],
        "--data.seq_len", str(opts["seq_len"]),
        "--train.micro_batch_size", str(opts["micro_batch"]),
        "--train.global_batch_size", str(opts["micro_batch"] * world_size * opts["accum"]),
        "--train.precision", opts["precision"], "--parallel.reduce_bucket_mb", str(opts["bucket_mb"]),
        "--parallel.zero", str(zero), "--run.out_dir", f"{work}/zero{zero}",
        "--checkpoint.resume", "none"])


def _stage(zero: int, world_size: int, opts: dict, work: str) -> dict:
    from polytrain.train.trainer import Trainer

    cfg = _config(zero, world_size, opts, work)
    reset_peak_rss()
    rss_start = rss_mib("VmRSS")
    trainer = Trainer(cfg)
    probe = StepProbe()
    # After each micro-batch's backward: the next micro-batch's announcement finishes its
    # reductions first. Then right before the optimizer step.
    announce, optimizer_step = trainer.dp.before_micro_batch, trainer.dp.step
    memory: dict[str, int] = {}
    announced = [0]  # micro-batches of this step so far

    def before_micro_batch(model, last: bool) -> None:
        announce(model, last)
        if announced[0]:  # the previous micro-batch's backward and reductions are done
            probe()
        announced[0] += 1

    def measured_step() -> None:
        probe()
        if probe.on:
            memory.update(model_state_bytes(trainer))
        optimizer_step()
        announced[0] = 0

    trainer.dp.before_micro_batch, trainer.dp.step = before_micro_batch, measured_step
    # Step 1 creates the optimizer state (and runs FSDP2's lazy init); step 2 is measured.
    trainer.train_step()
    probe.on = True
    with CommCounter() as comm:
        trainer.train_step()
    trainer.dp.before_micro_batch, trainer.dp.step = announce, optimizer_step
    named = list(trainer.model.named_parameters())
    psi = sum(p.numel() for _, p in named)  # a DTensor's numel is the global count
    psi_root = sum(p.numel() for name, p in named if not name.startswith("layers."))
    last = f"layers.{len(trainer.model.layers) - 1}."
    psi_last = sum(p.numel() for name, p in named if name.startswith(last))
    result = {"zero": zero, "nproc": world_size, "psi": psi, "psi_root": psi_root, "psi_last": psi_last,
              "memory": memory, "live_peak": probe.peak, "live_points": probe.points,
              "comm_model": comm.total("model"), "comm_small": comm.total("small"),
              "collectives": comm.calls, "peak_rss_mib": rss_mib(), "rss_start_mib": rss_start,
              "reduce_psi": buffers_sent(None, trainer.runtime.acc.reduce_scatter_by_all_reduce)}
    trainer.close()
    return result


def _deepspeed_stage(zero: int, world_size: int, opts: dict, work: str) -> dict:
    """DeepSpeed's engine on the same model, batches and precision; its live bytes, measured alike."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vs_deepspeed import DeepSpeedJob

    probe = StepProbe()
    job = DeepSpeedJob(_config(zero, world_size, opts, work), zero, on_optimizer_step=probe)
    job.train_step(after_backward=probe)  # step 1: optimizer state, lazy buffers
    probe.on = True
    job.train_step(after_backward=probe)
    return {"zero": zero, "nproc": world_size, "live_peak": probe.peak, "live_points": probe.points}


def _measure(rank: int, world_size: int, opts: dict, work: str) -> dict[str, list[dict]]:
    results = {"polytrain": [], "deepspeed": []}
    for zero in opts["zero"]:
        results["polytrain"].append(_stage(zero, world_size, opts, work))
        gc.collect()  # free this stage's trainer before the next one's peak RSS is reset
    if opts["deepspeed"]:
        for zero in opts["zero"]:
            results["deepspeed"].append(_deepspeed_stage(zero, world_size, opts, work))
            gc.collect()
    return results


# ----- report ---------------------------------------------------------------------------


def summarise(per_rank: list[dict[str, list[dict]]], opts: dict) -> list[dict]:
    """One row per stage: the largest rank's figures (it bounds memory) and the spread."""
    gather_bytes = 2 if opts["precision"] == "bf16" else 4
    rows = []
    deepspeed = list(zip(*[r["deepspeed"] for r in per_rank])) or [None] * len(per_rank[0]["polytrain"])
    for stage, ds in zip(zip(*[r["polytrain"] for r in per_rank]), deepspeed):
        first, n = stage[0], stage[0]["nproc"]
        peaks = [r["live_peak"] for r in stage]
        comms = [r["comm_model"] for r in stage]
        psi = first["psi"]
        theory_mem = THEORY[opts["precision"]][first["zero"]][1](n) * psi
        expected = expected_comm(first["zero"], n, opts["accum"], psi, first["psi_root"] + first["psi_last"],
                                 gather_bytes, first["reduce_psi"])
        row = {
            **first, "memory_by_rank": [r["memory"] for r in stage],
            "memory": max((r["memory"] for r in stage), key=lambda m: sum(m.values())),
            "state_bytes": max(peaks), "state_spread": max(peaks) - min(peaks),
            "theory_bytes": theory_mem, "state_ratio": max(peaks) / theory_mem,
            "comm_bytes": max(comms), "comm_spread": max(comms) - min(comms),
            "expected_comm": expected, "comm_ratio": max(comms) / expected,
            "comm_small": max(r["comm_small"] for r in stage),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in stage),
            "rss_start_mib": max(r["rss_start_mib"] for r in stage),
        }
        if ds is not None:
            row["ds_state_bytes"] = max(r["live_peak"] for r in ds)
            row["ds_state_ratio"] = row["ds_state_bytes"] / theory_mem
        rows.append(row)
    return rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.1f}"


def report(args: argparse.Namespace, rows: list[dict], ds_version: str | None) -> str:
    from polytrain.backend import get_accelerator

    psi, psi_root, psi_last = rows[0]["psi"], rows[0]["psi_root"], rows[0]["psi_last"]
    by_all_reduce = rows[0]["reduce_psi"] == 2
    command = " ".join(["python benchmarks/zero_memory_comm.py", *sys.argv[1:]])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    ds = f", deepspeed {ds_version}" if ds_version else ""
    states = ("16-bit weights and gradients, fp32 masters and Adam moments" if args.precision == "bf16"
              else "fp32 weights, gradients and Adam moments")
    lines = [
        f"Machine: {get_accelerator().describe()} | gloo{ds} | {datetime.date.today().isoformat()} | "
        f"load average {load:.1f}",
        (f"Model: llama {args.size} (psi = {psi:,} parameters), seq {args.seq_len}, micro-batch "
         f"{args.micro_batch}, {args.accum} micro-batches per step, {args.precision} ({states}), AdamW; "
         f"step 2 measured, the largest rank shown"),
        f"Command: `{command}`",
        "",
        ("| zero | N | polytrain params + masters / grads / optim MiB (at the step) | polytrain model "
         "state MiB (peak) | DeepSpeed model state MiB (peak) | theory MiB | polytrain / theory "
         "| DeepSpeed / theory | sent MiB/step | expected MiB/step | ratio |"),
        "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        m, formula = r["memory"], THEORY[args.precision][r["zero"]][0]
        ds_bytes = _mib(r["ds_state_bytes"]) if "ds_state_bytes" in r else "-"
        ds_ratio = f"{r['ds_state_ratio']:.3f}" if "ds_state_ratio" in r else "-"
        lines.append(
            f"| {r['zero']} | {r['nproc']} | {_mib(m['params'] + m['masters'])} / {_mib(m['grads'])} / "
            f"{_mib(m['optimizer'])} | {_mib(r['state_bytes'])} | {ds_bytes} "
            f"| {formula} = {_mib(r['theory_bytes'])} | {r['state_ratio']:.3f} | {ds_ratio} "
            f"| {_mib(r['comm_bytes'])} | {_mib(r['expected_comm'])} | {r['comm_ratio']:.3f} |")
    uneven = [f"zero {r['zero']} N {r['nproc']}" for r in rows if r["state_spread"] or r["comm_spread"]]
    lines += [
        "",
        ("Model state: the bytes of every live tensor storage on the rank (found through the "
         "garbage collector, each storage once), taken after each micro-batch's backward and "
         "reductions and right before the optimizer step, the peak over the step; the same count "
         "for both frameworks. Theory (psi parameters, N ranks): "
         + ("the ZeRO paper's mixed-precision figures, 2 bytes of 16-bit params + 2 of 16-bit grads + "
            "K = 12 of fp32 master, exp_avg, exp_avg_sq, sharded as each stage shards them. ZeRO-1 "
            "peaks between micro-batches (whole 16-bit gradients, no gradient shard yet); ZeRO-2 "
            "holds a 16-bit gradient shard; zero 0 and 3 (FSDP2) keep fp32 gradients, but not the "
            "16-bit ones, beside the fp32 shards that are the masters."
            if args.precision == "bf16" else
            "fp32 params and grads (4 bytes each); FSDP2 (zero 0, 3) steps the fp32 parameters "
            "themselves (K = 8), ZeRO-1/2 keep an fp32 master shard beside the replicas (K = 12).")
         + f" DeepSpeed keeps its reduce and gather buckets ({args.bucket_mb:g} MiB each, "
         "--bucket-mb, for both) allocated through the step, polytrain only while a reduction or "
         "gather runs: on a small model that is much of DeepSpeed's excess over the theory."),
        ("Communication (polytrain): gradients are reduced in fp32 "
         + ("as an all-reduce (this backend's reduce-scatter is slower: twice the bytes)" if by_all_reduce
            else "by reduce-scatter (through shared memory between ranks of one host)")
         + f", parameters gathered in {'16' if args.precision == 'bf16' else '32'} bits; zero 0 all-reduces "
         "once per step, ZeRO-1 reduces once, ZeRO-2 every micro-batch, ZeRO-3 all-gathers each unit "
         f"in forward and again in backward except the root ({psi_root:,} parameters: embedding, final "
         f"norm, head) and the last block ({psi_last:,}), which stay gathered (expected_comm). A ring "
         "all-reduce sends 2(N-1)/N of the buffer, all-gather and reduce-scatter (N-1)/N. Collectives "
         "under 4 KiB (loss, gradient norm) are left out."),
        ("Peak RSS of the polytrain stages, for information (VmHWM, reset per stage; MiB): "
         + ", ".join(f"zero {r['zero']} N {r['nproc']} {r['peak_rss_mib']:,.0f}" for r in rows) + "."),
    ]
    if uneven:
        lines.append(f"Ranks differ (largest shown) in: {', '.join(uneven)}.")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    from polytrain.config import load_config
    from polytrain.data import prepare_corpus

    ds_version = None
    if args.deepspeed != "no":
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
        try:
            import deepspeed

            ds_version = deepspeed.__version__
        except ImportError:
            if args.deepspeed == "yes":
                raise SystemExit("error: --deepspeed yes, but deepspeed is not installed") from None
    # Tokenize once here, so the ranks only read the cache.
    cfg = load_config(None, ["--model.size", args.size, "--data.source", args.source,
                             "--data.seq_len", str(args.seq_len)])
    prepare_corpus(cfg.data, cfg.model.vocab_size)
    # glibc's default mmap threshold, but fixed (setting it stops glibc raising it as large
    # blocks are freed): tensors are unmapped when freed, so a stage's peak RSS is not
    # inflated by heap an earlier stage left behind. The ranks inherit the environment.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    opts = {k: getattr(args, k) for k in ("size", "seq_len", "micro_batch", "zero", "source", "precision", "accum",
                                          "bucket_mb")}
    opts["deepspeed"] = ds_version is not None
    rows = []
    with tempfile.TemporaryDirectory(prefix="polytrain-zero-") as work:
        for n in args.nproc:
            print(f"nproc {n}: zero {' '.join(map(str, args.zero))} ...", flush=True)
            rows += summarise(run_ranks(n, _measure, opts, f"{work}/n{n}", timeout=3600), opts)
    table = report(args, rows, ds_version)
    print("\n" + table)
    if args.json:
        record = {"torch": torch.__version__, "deepspeed": ds_version, "date": datetime.date.today().isoformat(),
                  "args": vars(args), "rows": rows, "table": table}
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
