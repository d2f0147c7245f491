"""Time from a worker's death to training again, in an elastic local job (`--parallel.nproc MIN:MAX`).

    python benchmarks/elastic_recovery.py                   # ~1-2 min on a quiet 2-core CPU
    python benchmarks/elastic_recovery.py --nproc 4 --kill-step 12 --snapshot-every 0 --checkpoint-every 4

A tiny llama (0.1M parameters) trains for `--steps` steps on `--nproc` local workers; at
`--kill-step` rank nproc-1 SIGKILLs itself (as the OOM killer would). The launcher notices the
death, stops the others, restarts one worker smaller, and the job resumes from its newest
host-memory snapshot (or disk checkpoint) at the new size. From the launcher's event log
(<run dir>/elastic.jsonl):

    detect    death -> the launcher's failure event (its 0.1 s poll plus the 1 s it lets other
              deaths of the same event arrive)
    stop      the failure -> the smaller attempt started (the survivors stopped: SIGTERM)
    restart   the start -> the first step finished at the new size (processes start, import
              torch, join the process group, build and shard the model, load the snapshot, one step)

and the steps redone (the death's step minus the step resumed from). TorchFT users report
hundreds of seconds for the same (torchft #329: 948 s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
         "--model.ffn_dim", "128", "--model.vocab_size", "512", "--data.seq_len", "64"]


def corpus(path: Path) -> Path:
    """~400 KB of stdlib sources as one .jsonl (as the tests' corpus)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with path.open("w") as f:
        for file in sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py")):
            f.write(json.dumps({"text": file.read_text(encoding="utf-8", errors="replace")}) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-step", type=int, default=12)
    p.add_argument("--snapshot-every", type=int, default=1)
    p.add_argument("--checkpoint-every", type=int, default=0)
    args = p.parse_args()
    from polytrain.cli import main as cli
    from polytrain.train.elastic_launch import SETTLE_S, read_events
    from polytrain.train.faults import KILL_ENV

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        os.environ.setdefault("POLYTRAIN_CACHE", str(Path(tmp) / "cache"))
        os.environ[KILL_ENV] = f"{args.nproc - 1}:{args.kill_step}:0"
        argv = ["train", *MODEL, "--data.source", str(corpus(Path(tmp) / "c.jsonl")), "--run.out_dir", str(run),
                "--run.steps", str(args.steps), "--run.log_every", "1", "--run.eval_every", "0",
                "--run.sample_tokens", "0", "--train.micro_batch_size", "3", "--train.global_batch_size", "12",
                "--checkpoint.snapshot_every", str(args.snapshot_every),
                "--checkpoint.every", str(args.checkpoint_every), "--parallel.nproc", f"2:{args.nproc}"]
        began = time.perf_counter()
        code = cli(argv)
        total = time.perf_counter() - began
        events = read_events(run)
    assert code == 0, f"the elastic job failed with {code}"
    failure = next(e for e in events if e["event"] == "failure")
    start = next(e for e in events if e["event"] == "start" and e["attempt"] == 1)
    again = next(e for e in events if e["event"] == "training" and e["time"] > start["time"])
    death = failure["time"] - SETTLE_S
    print(f"\n{datetime.date.today()}, {os.cpu_count()} cores, load average {load:.1f} at start; {args.nproc} -> "
          f"{start['world']} workers, SIGKILL at step {args.kill_step} of {args.steps}, "
          f"{'snapshot every ' + str(args.snapshot_every) if args.snapshot_every else 'checkpoint every ' + str(args.checkpoint_every)}\n")
    print("| detect s | stop s | restart to the first step s | death to training again s | steps redone | job s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {failure['time'] - death:.1f} | {start['time'] - failure['time']:.1f} | "
          f"{again['time'] - start['time']:.1f} | {again['time'] - death:.1f} | "
          f"{args.kill_step - again['step']} | {total:.0f} |")
    print(f"\nCommand: python benchmarks/elastic_recovery.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
