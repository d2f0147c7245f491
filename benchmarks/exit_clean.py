"""Consecutive two-rank jobs, each of which must exit 0 (issue 14 part 6).

A finished job used to abort at interpreter teardown now and then ("terminate called
without an active exception", SIGABRT) after every rank had reported. This runs N jobs in a
row, alternating the two ways polytrain's code ends a multi-rank process:

  train   polytrain train --parallel.nproc 2 (workers end through train/worker_exit.py)
  engine  the DeepSpeed-style example under torchrun, which never destroys its process
          group itself (polytrain's exit handler in distributed/world.py does)

and prints every job's exit code and how many aborted.

    python benchmarks/exit_clean.py --runs 50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DS_CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
             "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}


def corpus(path: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with path.open("w") as f:
        for file in sorted((stdlib / "json").glob("*.py")):
            f.write(json.dumps({"text": file.read_text(encoding="utf-8")}) + "\n")
    return path


def commands(work: Path) -> dict[str, list[str]]:
    data = corpus(work / "corpus.jsonl")
    (work / "ds.json").write_text(json.dumps(DS_CONFIG))
    train = [sys.executable, "-m", "polytrain.cli", "train", "--parallel.nproc", "2",
             "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
             "--model.ffn_dim", "128", "--model.vocab_size", "512", "--data.source", str(data),
             "--data.seq_len", "64", "--data.val_fraction", "0.1", "--train.micro_batch_size", "2",
             "--train.global_batch_size", "8", "--run.steps", "2", "--run.eval_every", "0",
             "--run.sample_tokens", "0", "--run.out_dir", str(work / "runs")]
    engine = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              str(ROOT / "examples/deepspeed_style/train.py"), "--deepspeed_config", str(work / "ds.json"),
              "--data", str(data), "--seq_len", "64", "--steps", "2"]
    return {"train": train, "engine": engine}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    env = {**os.environ, "POLYTRAIN_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = commands(Path(tmp))
        codes: list[tuple[str, int, bool]] = []
        start = time.time()
        for i in range(args.runs):
            kind = ("train", "engine")[i % 2]
            fresh = ["--run.name", f"job{i}"] if kind == "train" else []  # a new run, not a resume
            done = subprocess.run(jobs[kind] + fresh, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
            aborted = "terminate called" in done.stderr or done.returncode == -6
            codes.append((kind, done.returncode, aborted))
            print(f"{i + 1:3d} {kind:6s} exit {done.returncode}{'  ABORTED' if aborted else ''}", flush=True)
            if done.returncode != 0 and not aborted:
                print(done.stderr[-2000:], file=sys.stderr)
    bad = [c for c in codes if c[1] != 0]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}: {len(codes) - len(bad)}/{len(codes)} two-rank jobs exited 0, "
          f"{sum(c[2] for c in codes)} aborted, {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
