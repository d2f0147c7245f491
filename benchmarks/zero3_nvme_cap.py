"""A model whose fp32 Adam state exceeds a memory cap trains under ZeRO-3 with nvme offload.

    python benchmarks/zero3_nvme_cap.py                        # ~270M parameters, 2 ranks, ~15-30 min on 2 cores
    python benchmarks/zero3_nvme_cap.py --layers 2 --steps 2   # a quick check that it runs

The model: a Llama of --dim 1024 and --layers 20 (about 270M parameters at vocabulary
8192), bf16 model states (16-bit weights and gradients, fp32 masters and Adam moments:
16 bytes per parameter, 4.3 GB), ZeRO-3 over --nproc 2 gloo ranks. Four jobs, each in
fresh ranks, each training --steps optimizer steps on the same batches:

1. reference: ZeRO-3 without offload and without a cap: the losses to reproduce, and
   each rank's peak virtual size (VmPeak) and resident set (VmHWM);
2. nvme, uncapped: ZeRO-3 with parallel.offload_params = nvme (parameters, gradients and
   optimizer state in files under --nvme-path), for its VmPeak;
3. the cap: RLIMIT_AS of every rank set to --cap-gib, or by default half-way between
   the two jobs' largest VmPeak, so an allocation that would pass it fails. ZeRO-3
   without offload under the cap must fail; the error it stops with is reported;
4. nvme under the cap: must train, to the same losses as the reference.

RLIMIT_AS bounds the address space, a stricter bound than resident memory (the cap
counts what the process has mapped, touched or not). Reported: losses, per-rank peak
RSS and VmPeak, seconds per step, and the bytes the nvme jobs read and wrote.

DeepSpeed's ZeRO-3 nvme offload (offload_param and offload_optimizer on nvme) is tried
the same way when its async_io op can be built (it needs libaio's headers); otherwise
the reason is reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.multirank is not installed
from tests.multirank import run_ranks

GiB = 2**30


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--source", default="stdlib", help="data.source (tokenized once, then cached)")
    p.add_argument("--nvme-path", type=Path, default=None, help="directory for the offload files (a temp dir)")
    p.add_argument("--cap-gib", type=float, default=None, help="RLIMIT_AS per rank (default: see above)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    return p.parse_args()


def overrides(args: argparse.Namespace, run_dir: str, *extra: str) -> list[str]:
    heads = args.dim // 64
    return ["--model.dim", str(args.dim), "--model.n_layers", str(args.layers), "--model.n_heads", str(heads),
            "--model.n_kv_heads", str(heads), "--model.ffn_dim", str(args.dim * 11 // 4 // 64 * 64),
            "--model.vocab_size", str(args.vocab), "--data.source", args.source,
            "--data.seq_len", str(args.seq_len), "--train.micro_batch_size", "1",
            "--train.global_batch_size", str(2 * args.nproc), "--train.precision", "bf16",
            "--train.warmup_steps", "1", "--parallel.zero", "3", "--run.out_dir", run_dir,
            "--run.steps", str(args.steps), "--checkpoint.resume", "none", *extra]


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def _job(rank: int, world_size: int, config: list[str], cap: float | None) -> dict:
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    if cap is not None:
        resource.setrlimit(resource.RLIMIT_AS, (int(cap), int(cap)))
    trainer = Trainer(load_config(None, config))
    losses, seconds = [], []
    for _ in range(trainer.cfg.run.steps):
        start = time.perf_counter()
        losses.append(trainer.train_step()["loss"])
        seconds.append(time.perf_counter() - start)
    io = getattr(trainer.dp, "io", None)
    result = {"rank": rank, "losses": losses, "seconds": seconds, "vm_peak": _status("VmPeak"),
              "peak_rss": _status("VmHWM"), "read": io.bytes_read if io else 0,
              "written": io.bytes_written if io else 0,
              "params": sum(p.numel() for p in trainer.model.parameters())}
    trainer.close()
    return result


def _deepspeed_job(rank: int, world_size: int, config: list[str], cap: float | None, nvme: str) -> dict:
    """DeepSpeed's ZeRO-3 with parameters and optimizer state offloaded to nvme, on the same model and data."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vs_deepspeed import DeepSpeedJob

    from polytrain.config import load_config

    if cap is not None:
        resource.setrlimit(resource.RLIMIT_AS, (int(cap), int(cap)))
    cfg = load_config(None, config)
    offload = {"device": "nvme", "nvme_path": nvme}
    job = DeepSpeedJob(cfg, 3, zero_options={"offload_param": offload, "offload_optimizer": offload})
    losses, seconds = [], []
    for _ in range(cfg.run.steps):
        start = time.perf_counter()
        losses.append(job.train_step())
        seconds.append(time.perf_counter() - start)
    return {"rank": rank, "losses": losses, "seconds": seconds, "vm_peak": _status("VmPeak"),
            "peak_rss": _status("VmHWM"), "read": 0, "written": 0, "params": 0}


def deepspeed_nvme_missing() -> str | None:
    """Why DeepSpeed's nvme offload cannot run here (None if it can): it needs its async_io op."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return "deepspeed is not installed"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return "DeepSpeed's async_io op cannot be built (it needs libaio's headers: apt install libaio-dev)"
    return None


def run(args: argparse.Namespace, name: str, config: list[str], cap: float | None, job=_job,
        *extra) -> dict:
    """One job in fresh ranks: its per-rank figures, or the first error line it failed with."""
    print(f"{name} ...", flush=True)
    try:
        ranks = run_ranks(args.nproc, job, config, cap, *extra, timeout=7200)
    except AssertionError as failure:
        text = str(failure)
        lines = [line.strip() for line in text.splitlines() if "Error" in line or "died" in line]
        return {"failed": True, "error": (lines[-1] if lines else text.splitlines()[0])[:300]}
    return {"failed": False, "ranks": ranks}


def main() -> None:
    args = parse_args()
    from polytrain.backend import get_accelerator
    from polytrain.config import load_config
    from polytrain.data import prepare_corpus

    os.environ.setdefault("MALLOC_ARENA_MAX", "2")  # glibc's per-thread arenas would reserve address space
    with tempfile.TemporaryDirectory(prefix="polytrain-nvme-cap-") as work:
        nvme = str(args.nvme_path or Path(work) / "nvme")
        prepare_corpus(load_config(None, overrides(args, work)).data, args.vocab)
        offload = ["--parallel.offload_params", "nvme", "--parallel.nvme_path", nvme]
        jobs = {"reference": run(args, "reference (ZeRO-3, no offload, no cap)", overrides(args, f"{work}/a"), None),
                "nvme": run(args, "nvme offload, no cap", overrides(args, f"{work}/b", *offload), None)}
        if jobs["reference"]["failed"] or jobs["nvme"]["failed"]:
            raise SystemExit(f"error: an uncapped job failed: {jobs}")
        peak = {name: max(r["vm_peak"] for r in job["ranks"]) for name, job in jobs.items()}
        cap = args.cap_gib * GiB if args.cap_gib else (peak["reference"] + peak["nvme"]) / 2
        jobs["capped"] = run(args, f"ZeRO-3 without offload, capped at {cap / GiB:.2f} GiB",
                             overrides(args, f"{work}/c"), cap)
        jobs["capped nvme"] = run(args, f"nvme offload, capped at {cap / GiB:.2f} GiB",
                                  overrides(args, f"{work}/d", *offload), cap)
        missing = deepspeed_nvme_missing()
        if missing is None:
            jobs["DeepSpeed nvme"] = run(args, "DeepSpeed ZeRO-3 nvme offload, no cap", overrides(args, f"{work}/e"),
                                         None, _deepspeed_job, f"{nvme}/ds")
            jobs["DeepSpeed capped nvme"] = run(args, f"DeepSpeed ZeRO-3 nvme offload, capped at {cap / GiB:.2f} GiB",
                                                overrides(args, f"{work}/f"), cap, _deepspeed_job, f"{nvme}/ds")
    psi = jobs["reference"]["ranks"][0]["params"]  # a DTensor's numel is the whole parameter's
    lines = [
        f"Machine: {get_accelerator().describe()} | {args.nproc} gloo ranks | "
        f"{datetime.date.today().isoformat()} | load average {os.getloadavg()[0]:.1f}",
        (f"Model: llama dim {args.dim}, {args.layers} layers, vocabulary {args.vocab} (about {psi / 1e6:.0f}M "
         f"parameters; bf16 model states 16 psi = {16 * psi / GiB:.2f} GiB, {16 * psi / args.nproc / GiB:.2f} "
         f"GiB per rank under ZeRO-3), seq {args.seq_len}, micro-batch 1, 2 micro-batches per step; "
         f"RLIMIT_AS per rank {cap / GiB:.2f} GiB"),
        f"Command: `python benchmarks/zero3_nvme_cap.py {' '.join(sys.argv[1:])}`",
        "",
        "| job | cap | result | losses | s/step (median) | peak RSS GiB | VmPeak GiB | nvme read / written GiB (start-up included) |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, job in jobs.items():
        capped = "capped" in name
        if job["failed"]:
            lines.append(f"| {name} | {cap / GiB:.2f} GiB | fails: {job['error']} | | | | | |")
            continue
        r0 = job["ranks"][0]
        step = sorted(max(r["seconds"][i] for r in job["ranks"]) for i in range(len(r0["seconds"])))
        moved = max(r["read"] for r in job["ranks"]) / GiB, \
            max(r["written"] for r in job["ranks"]) / GiB
        lines.append(
            f"| {name} | {f'{cap / GiB:.2f} GiB' if capped else 'none'} | trains | "
            f"{' '.join(f'{x:.4f}' for x in r0['losses'])} | {step[len(step) // 2]:.1f} "
            f"| {max(r['peak_rss'] for r in job['ranks']) / GiB:.2f} | {max(r['vm_peak'] for r in job['ranks']) / GiB:.2f} "
            f"| {moved[0]:.2f} / {moved[1]:.2f} |")
    same = not jobs["capped nvme"]["failed"] and \
        jobs["capped nvme"]["ranks"][0]["losses"] == jobs["reference"]["ranks"][0]["losses"]
    lines += ["", f"Capped nvme losses equal the reference's exactly: {same}."]
    if missing is not None:
        lines.append(f"DeepSpeed's ZeRO-3 nvme offload was not run: {missing}.")
    else:
        lines.append("DeepSpeed builds the model whole on every rank before partitioning it (no zero.Init, so "
                     "that both start from polytrain's initial weights); its read/written bytes are not counted.")
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        args.json.write_text(json.dumps({"jobs": jobs, "cap": cap, "args": vars(args), "table": table},
                                        indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
