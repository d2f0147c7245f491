"""ZeRO stages 0-3: model-state bytes and communication per rank, measured, against theory.

    python benchmarks/zero_memory_comm.py                   # ~3-5 min on 2 cores: nproc 2 and 4
    python benchmarks/zero_memory_comm.py --size tiny --nproc 2   # ~1 min check that it runs
    python benchmarks/zero_memory_comm.py --json zero.json  # also writes every figure as JSON

For each nproc, one set of gloo ranks builds `Trainer(cfg)` for `parallel.zero` 0, 1, 2, 3 in
turn (fp32, AdamW, global batch = micro-batch x nproc, so one micro-batch per step) and runs
two `train_step()`s; the second is measured:

1. Model-state bytes on each rank, right before the optimizer step (`trainer.dp.step` is
   wrapped): the local storage of the compute parameters (ZeRO-3: DTensor shards), of
   ZeRO-1/2's fp32 master shards, of the gradients held then and of the optimizer state,
   each storage counted once. Theory: fp32 Adam, see `THEORY`.
2. Bytes each rank sends during the whole step, counted by wrapping the torch.distributed
   collectives, as a ring algorithm moves them. Theory: 2 psi (N-1)/N x 4 bytes for
   DDP/ZeRO-1/2, 3 psi (N-1)/N x 4 for ZeRO-3. Collectives of under 4 KiB (the loss average,
   the gradient norm) are reported apart.
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
from pathlib import Path
from typing import Self

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.multirank is not installed
from tests.multirank import run_ranks

MiB = 2**20
SMALL_COLLECTIVE = 4096  # bytes; smaller collectives are bookkeeping (loss, grad norm)

# psi = parameter count, N = data-parallel ranks; bytes per rank, fp32 AdamW.
# The paper's (Rajbhandari et al. 2020, Fig. 1) mixed-precision figures are
# 2psi fp16 params + 2psi fp16 grads + K psi optimizer state with K = 12
# (fp32 master + exp_avg + exp_avg_sq). In fp32 params and grads are 4psi each;
# a plain fp32 optimizer needs no master (K = 8), but polytrain's ZeRO-1/2 keep a
# separate fp32 master shard next to the replicated compute parameters, so there
# K = 12 again. FSDP2 (zero 0 and 3) steps the parameters themselves: K = 8.
THEORY = {
    0: ("16psi", lambda n: 4 + 4 + 8),
    1: ("8psi+12psi/N", lambda n: 4 + 4 + 12 / n),
    2: ("4psi+16psi/N", lambda n: 4 + (4 + 12) / n),
    3: ("16psi/N", lambda n: (4 + 4 + 8) / n),
}
PAPER = {0: "16psi", 1: "4psi+12psi/N", 2: "2psi+14psi/N", 3: "16psi/N"}  # mixed precision, K = 12
COMM_THEORY = {0: 2, 1: 2, 2: 2, 3: 3}  # psi-sized transfers per step; x (N-1)/N x 4 bytes per rank


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small",
                   help="model size preset (big enough that model state dwarfs the rest)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
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

    def _wrap(self, module, name: str, buffer_arg: str, share: str, group_size, label: str) -> None:
        original = getattr(module, name)
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            if self._depth == 0:
                bound = signature.bind(*args, **kwargs)
                n = group_size(bound.arguments.get("group"))
                nbytes = _nbytes(bound.arguments[buffer_arg])
                kind = "small" if nbytes < SMALL_COLLECTIVE else "model"
                entry = self.calls.setdefault(f"{label} ({kind})", [0, 0])
                entry[0] += 1
                entry[1] += SENT_SHARE[share](n) * nbytes
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        self._saved.append((module, name, original))
        setattr(module, name, counted)

    def __enter__(self) -> Self:
        for name, (arg, share) in C10D.items():
            for module in (dist, c10d):  # the same functions under two names; callers use either
                if hasattr(module, name):
                    self._wrap(module, name, arg, share, lambda g: dist.get_world_size(g), name)
        for name, (arg, share) in FUNCOL.items():
            self._wrap(funcol, name, arg, share, _funcol_size, f"funcol.{name}")
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
    """Bytes of the storages behind params, fp32 masters, gradients and optimizer state.

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


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux)
        f.write("5")


def rss_mib(field: str = "VmHWM") -> float:
    """VmHWM (peak resident set) or VmRSS (now) of this process, in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


# ----- one set of ranks -------------------------------------------------------------------


def _stage(zero: int, world_size: int, opts: dict, work: str) -> dict:
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    cfg = load_config(None, [
        "--model.size", opts["size"], "--data.source", opts["source"],
        "--data.seq_len", str(opts["seq_len"]),
        "--train.micro_batch_size", str(opts["micro_batch"]),
        # One micro-batch per step: ZeRO-2/3 reduce-scatter once per micro-batch, so the
        # per-step theory holds only without accumulation.
        "--train.global_batch_size", str(opts["micro_batch"] * world_size),
        "--parallel.zero", str(zero), "--run.out_dir", f"{work}/zero{zero}",
        "--checkpoint.resume", "none"])
    reset_peak_rss()
    rss_start = rss_mib("VmRSS")
    trainer = Trainer(cfg)
    # Step 1 creates the optimizer state (and runs FSDP2's lazy init); step 2 is measured.
    trainer.train_step()
    memory: dict[str, int] = {}
    optimizer_step = trainer.dp.step

    def measured_step() -> None:
        memory.update(model_state_bytes(trainer))
        optimizer_step()

    trainer.dp.step = measured_step
    with CommCounter() as comm:
        trainer.train_step()
    trainer.dp.step = optimizer_step
    named = list(trainer.model.named_parameters())
    psi = sum(p.numel() for _, p in named)  # a DTensor's numel is the global count
    psi_root = sum(p.numel() for name, p in named if not name.startswith("layers."))
    last = f"layers.{len(trainer.model.layers) - 1}."
    psi_last = sum(p.numel() for name, p in named if name.startswith(last))
    result = {"zero": zero, "nproc": world_size, "psi": psi, "psi_root": psi_root, "psi_last": psi_last,
              "memory": memory,
              "comm_model": comm.total("model"), "comm_small": comm.total("small"),
              "collectives": comm.calls, "peak_rss_mib": rss_mib(), "rss_start_mib": rss_start}
    trainer.metrics.close()
    # ZeRO-1/2's gradient hooks (bound methods of the strategy, held by autograd in C++) form
    # a cycle the garbage collector cannot see: without this the model, masters and
    # optimizer state of the stage stay resident into the next stage.
    for p in trainer.model.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks:
            hooks.clear()
    return result


def _measure(rank: int, world_size: int, opts: dict, work: str) -> list[dict]:
    results = []
    for zero in opts["zero"]:
        results.append(_stage(zero, world_size, opts, work))
        gc.collect()  # free this stage's trainer before the next one's peak RSS is reset
    return results


# ----- report ---------------------------------------------------------------------------


def summarise(per_rank: list[list[dict]]) -> list[dict]:
    """One row per stage: the largest rank's figures (it bounds memory) and the spread."""
    rows = []
    for stage in zip(*per_rank):
        first, n = stage[0], stage[0]["nproc"]
        totals = [sum(r["memory"].values()) for r in stage]
        comms = [r["comm_model"] for r in stage]
        psi = first["psi"]
        theory_mem = THEORY[first["zero"]][1](n) * psi
        theory_comm = COMM_THEORY[first["zero"]] * psi * (n - 1) / n * 4
        rows.append({
            **first, "memory_by_rank": [r["memory"] for r in stage],
            "memory": max((r["memory"] for r in stage), key=lambda m: sum(m.values())),
            "state_bytes": max(totals), "state_spread": max(totals) - min(totals),
            "theory_bytes": theory_mem, "state_ratio": max(totals) / theory_mem,
            "comm_bytes": max(comms), "comm_spread": max(comms) - min(comms),
            "theory_comm": theory_comm, "comm_ratio": max(comms) / theory_comm,
            "comm_small": max(r["comm_small"] for r in stage),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in stage),
            "rss_start_mib": max(r["rss_start_mib"] for r in stage),
        })
    return rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.1f}"


def report(args: argparse.Namespace, rows: list[dict]) -> str:
    from polytrain.backend import get_accelerator

    psi, psi_root, psi_last = rows[0]["psi"], rows[0]["psi_root"], rows[0]["psi_last"]
    # Where the backend's reduce-scatter is slow, gradients are all-reduced (twice the bytes).
    by_all_reduce = get_accelerator().reduce_scatter_by_all_reduce
    reduce_psi = 2 if by_all_reduce else 1
    reduced_by = ("an all-reduce (this backend's reduce-scatter is slower)" if by_all_reduce
                  else "reduce-scatter")
    command = " ".join(["python benchmarks/zero_memory_comm.py", *sys.argv[1:]])
    lines = [
        f"Machine: {get_accelerator().describe()} | gloo | {datetime.date.today().isoformat()}",
        (f"Model: llama {args.size} (psi = {psi:,} parameters, {psi * 4 / MiB:,.1f} MiB fp32), seq "
         f"{args.seq_len}, micro-batch {args.micro_batch}, global batch = micro-batch x N (no "
         f"accumulation), fp32 AdamW; step 2 measured, the largest rank shown"),
        f"Command: `{command}`",
        "",
        ("| zero | N | params + masters / grads / optim MiB | model state MiB | theory (fp32) MiB "
         "| ratio | sent MiB/step | theory MiB/step | ratio | small collectives B "
         "| peak RSS MiB (at start) |"),
        "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        m, formula = r["memory"], THEORY[r["zero"]][0]
        lines.append(
            f"| {r['zero']} | {r['nproc']} | {_mib(m['params'] + m['masters'])} / "
            f"{_mib(m['grads'])} / {_mib(m['optimizer'])} | {_mib(r['state_bytes'])} "
            f"| {formula} = {_mib(r['theory_bytes'])} "
            f"| {r['state_ratio']:.3f} | {_mib(r['comm_bytes'])} | {_mib(r['theory_comm'])} "
            f"| {r['comm_ratio']:.3f} | {r['comm_small']:,.0f} | {r['peak_rss_mib']:,.0f} "
            f"({r['rss_start_mib']:,.0f}) |")
    uneven = [f"zero {r['zero']} N {r['nproc']}" for r in rows
              if r["state_spread"] or r["comm_spread"]]
    lines += [
        "",
        ("Theory, bytes per rank (psi parameters, N ranks): DeepSpeed's mixed-precision figures "
         f"are {', '.join(f'ZeRO-{z} {f}' for z, f in PAPER.items() if z)} (DDP {PAPER[0]}): "
         "2 bytes of fp16 params + 2 of fp16 grads + K = 12 of fp32 master, exp_avg, exp_avg_sq. "
         "In fp32 params and grads are 4 bytes; FSDP2 (zero 0, 3) steps the fp32 parameters themselves "
         "(K = 8), polytrain's ZeRO-1/2 keep an fp32 master shard beside the replicated compute "
         "parameters (K = 4 + 8 = 12): the theory column. Communication: a ring all-reduce sends "
         "2(N-1)/N of the buffer, all-gather and reduce-scatter (N-1)/N; DDP and ZeRO-1/2 move "
         "2 psi (all-reduce, or reduce-scatter + all-gather), ZeRO-3 3 psi (all-gather forward "
         "and backward, reduce-scatter)."),
        ("Measured at the optimizer step: with one micro-batch polytrain's ZeRO-1 has already "
         "reduce-scattered its gradients into fp32 shards during backward and freed the full "
         "ones, like ZeRO-2 (it holds full gradients only between micro-batches of an "
         "accumulating step), so its ratio is below 1 by the 4psi(1 - 1/N) of full gradients "
         "the theory counts."),
        (f"Gradients are reduced by {reduced_by}, {reduce_psi} psi of the bytes sent: ZeRO-1/2 "
         f"expect ({reduce_psi} psi + psi) / 2 psi = {(reduce_psi + 1) / 2:.3f}. ZeRO-3: the root "
         f"FSDP unit (embedding, final norm, output head: {psi_root:,} = {psi_root / psi:.0%} of "
         f"psi) stays gathered from forward to backward, and so does the last block "
         f"({psi_last:,}), which backward needs first: each is all-gathered once a step, not "
         f"twice: expected ratio (3 psi - psi_root - psi_last + {reduce_psi - 1} psi) / 3 psi = "
         f"{(3 * psi - psi_root - psi_last + (reduce_psi - 1) * psi) / (3 * psi):.3f}."),
        ("Small collectives (under 4 KiB: the loss average, the gradient norm) are not in the "
         "sent column; FSDP2's zero-0 replicas and ZeRO-3 on a (1, N) mesh also issue "
         "collectives over size-1 groups, which send nothing."),
        ("Peak RSS: VmHWM of the process over the stage (reset when it starts; in brackets the "
         "RSS then): the stages run one after another in the same processes, so it includes "
         "the libraries, the data, transient communication buffers and full parameter copies "
         "FSDP2 gathers, and the first stage also one-time start-up. For information only."),
    ]
    if uneven:
        lines.append(f"Ranks differ (largest shown) in: {', '.join(uneven)}.")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    from polytrain.config import load_config
    from polytrain.data import prepare_corpus

    # Tokenize once here, so the ranks only read the cache.
    cfg = load_config(None, ["--model.size", args.size, "--data.source", args.source,
                             "--data.seq_len", str(args.seq_len)])
    prepare_corpus(cfg.data, cfg.model.vocab_size)
    # glibc's default mmap threshold, but fixed (setting it stops glibc raising it as large
    # blocks are freed): tensors are unmapped when freed, so a stage's peak RSS is not
    # inflated by heap an earlier stage left behind. The ranks inherit the environment.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    opts = {k: getattr(args, k) for k in ("size", "seq_len", "micro_batch", "zero", "source")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="polytrain-zero-") as work:
        for n in args.nproc:
            print(f"nproc {n}: zero {' '.join(map(str, args.zero))} ...", flush=True)
            rows += summarise(run_ranks(n, _measure, opts, f"{work}/n{n}", timeout=1800))
    table = report(args, rows)
    print("\n" + table)
    if args.json:
        record = {"torch": torch.__version__, "date": datetime.date.today().isoformat(),
                  "args": vars(args), "rows": rows, "table": table}
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
