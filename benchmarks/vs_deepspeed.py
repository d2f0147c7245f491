"""polytrain's ZeRO-1/2/3 against DeepSpeed's, same model, data, batch and stage, side by side.

DeepSpeed is an optional peer, not a dependency of polytrain. Install it next to polytrain
(on a CPU-only machine keep the CPU build of torch, and skip building its C++ ops):

    pip install torch==2.13.0 && pip install -e .          # as in the README
    DS_BUILD_OPS=0 pip install deepspeed
    DS_ACCELERATOR=cpu python benchmarks/vs_deepspeed.py    # 30 torchrun jobs, ~25-35 min on 2 cores
    DS_ACCELERATOR=cpu python benchmarks/vs_deepspeed.py --loss plain   # both sides without the chunked loss
    DS_ACCELERATOR=cpu python benchmarks/vs_deepspeed.py --rounds 1 --steps 2 --warmup 1 \\
        --stages 1                                          # a quick check that it runs

DS_ACCELERATOR=cpu makes DeepSpeed use its CPU accelerator, whose collective backend is
gloo when Intel's oneCCL bindings are not installed (the script passes gloo explicitly).

For each ZeRO stage in --stages, --rounds rounds each launch two data-parallel jobs of
--nproc ranks with torchrun, one on DeepSpeed's engine and one on polytrain's Trainer
(who goes first swaps each round). Both jobs train the same Llama model
(`ARCHITECTURES["llama"]` at --size, initialised to the same weights), on the same
samples (polytrain's GlobalBatchSampler over the same packed token file, seeded alike),
with the same micro-batch, gradient accumulation, global batch, precision (--precision bf16,
the default: 16-bit weights and gradients over fp32 masters, DeepSpeed's `bf16` block and
polytrain's train.precision; or fp32), torch's AdamW with
the same hyperparameters and weight-decay groups, the same learning-rate schedule,
clipping by global norm, and the same reduce/all-gather bucket size (25 MiB, polytrain's
default). Each rank trains --warmup untimed steps, then --steps timed ones between two
barriers; it reports its peak resident memory (VmHWM of /proc/self/status) at the end.

The loss algorithm is the same on both sides: by default (`--loss chunked`) both compute the
output projection and cross-entropy a chunk of tokens at a time (polytrain's
train.chunked_loss; the DeepSpeed model's output Linear is swapped for polytrain's LossHead,
a module DeepSpeed's ZeRO-3 gathers like any other); `--loss plain` gives both the model's
logits into F.cross_entropy, as DeepSpeed's examples do.

What is not made equal: each framework keeps its own defaults for what has no counterpart
in the other (DeepSpeed's overlap_comm, contiguous_gradients, stage-3 prefetch and
persistence thresholds; polytrain's fused AdamW kernel, where DeepSpeed's `torch_adam`
takes torch's default, the per-tensor loop on a CPU, since its own fused Adam is a CUDA
op). `--polytrain-args` passes extra overrides to polytrain only (they come last and win,
e.g. `--loss plain --polytrain-args "--train.chunked_loss true --train.compile true"` runs each
framework its own way), `--deepspeed-compile` has DeepSpeed's jobs call `engine.compile()`. DeepSpeed's ZeRO-3 partitions the model inside
`deepspeed.initialize`, after it was built whole on each rank (no zero.Init), while
polytrain builds on the meta device; peak RSS counts that. The DeepSpeed ranks also
import deepspeed (tens of MiB): `rss at start` shows each job's memory before the model.

Ends with a markdown table for benchmarks/RESULTS.md: tokens/s and peak RSS of each, and
polytrain / DeepSpeed ratios (>1 on tokens/s is faster, <1 on RSS is leaner).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polytrain.config import Config, load_config
from polytrain.train.worker_exit import run_and_exit

FRAMEWORKS = ("deepspeed", "polytrain")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages to measure")
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks of each job")
    p.add_argument("--size", default="tiny", help="model size preset (tiny, small, 125m, ...)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--source", default="stdlib",
                   help="data.source (the first stdlib call tokenizes, ~30 s, then it is cached)")
    p.add_argument("--rounds", type=int, default=5, help="alternating jobs per framework and stage")
    p.add_argument("--loss", default="chunked", choices=("chunked", "plain"),
                   help="the loss algorithm of both sides (see the docstring)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16",
                   help="bf16: 16-bit weights and gradients, fp32 masters (both frameworks)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per job")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps per job first")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="threads shared by a job's ranks (each rank gets threads / nproc)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    p.add_argument("--polytrain-args", default="",
                   help='extra config overrides for the polytrain jobs only, e.g. "--train.chunked_loss false"')
    p.add_argument("--deepspeed-compile", action="store_true",
                   help="DeepSpeed's jobs call engine.compile() (as --polytrain-args '--train.compile true' does for polytrain)")
    # Internal: what torchrun starts on each rank.
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--zero", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The polytrain config both frameworks train from: model, data, batch, optimizer."""
    return ["--model.size", args.size, "--data.source", args.source,
            "--data.seq_len", str(args.seq_len),
            "--train.micro_batch_size", str(args.micro_batch),
            "--train.global_batch_size", str(args.global_batch),
            "--train.precision", args.precision, "--train.optimizer", "adamw",
            "--run.steps", str(args.warmup + args.steps),
            "--checkpoint.resume", "none", "--checkpoint.every", "0",
            "--train.chunked_loss", str(args.loss == "chunked").lower()]


def proc_status_kib(field: str) -> int | None:
    """A memory figure of this process from /proc/self/status (Linux only), in KiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


# ----- one rank ------------------------------------------------------------------------


class DeepSpeedJob:
    """One rank of DeepSpeed's engine training the polytrain model with polytrain's batches."""

    def __init__(self, cfg: Config, stage: int, on_optimizer_step=None, zero_options: dict | None = None,
                 compile_engine: bool = False):
        """`on_optimizer_step()` runs right before each optimizer step (a probe: zero_memory_comm.py);
        `zero_options` are added to the zero_optimization block (offload: zero3_nvme_cap.py);
        `compile_engine` calls DeepSpeed's `engine.compile()` (torch.compile of the module, inductor)."""
        import deepspeed  # the optional peer: only its own ranks import it

        from polytrain.data import GlobalBatchSampler, TokenDataset, prepare_corpus
        from polytrain.models import ARCHITECTURES
        from polytrain.models.common.init import init_plain
        from polytrain.optim.builder import param_groups

        deepspeed.init_distributed(dist_backend="gloo")
        self.rss_start_kib = proc_status_kib("VmRSS")
        rank, world = dist.get_rank(), dist.get_world_size()
        t = cfg.train
        self.cfg, self.accum = cfg, t.global_batch_size // (t.micro_batch_size * world)
        torch.manual_seed(cfg.run.seed)
        model = ARCHITECTURES["llama"].build(cfg.model)
        init_plain(model, cfg.run.seed)
        self.head = None
        if cfg.train.chunked_loss:  # the same loss algorithm as polytrain's: the head returns the loss
            from polytrain.train.chunked_loss import LossHead

            self.head = model.output = LossHead.replacing(model.output)
        # DeepSpeed counts bucket elements of the gradient dtype; keep polytrain's bytes.
        bucket = int(cfg.parallel.reduce_bucket_mb * 2**20) // (2 if t.precision == "bf16" else 4)
        config = {
            "train_batch_size": t.global_batch_size,
            "train_micro_batch_size_per_gpu": t.micro_batch_size,
            "gradient_accumulation_steps": self.accum,
            "optimizer": {"type": "AdamW", "params": {
                "lr": t.lr, "betas": [t.beta1, t.beta2], "eps": t.eps,
                "weight_decay": t.weight_decay, "torch_adam": True}},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": t.grad_clip,
            "fp16": {"enabled": False}, "bf16": {"enabled": t.precision == "bf16"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                  "allgather_bucket_size": bucket, **(zero_options or {})},
            "steps_per_print": 10**9, "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, t.weight_decay), config=config)
        if compile_engine:
            self.engine.compile()
        if on_optimizer_step is not None:
            inner = self.optimizer.step
            self.optimizer.step = lambda *a, **k: (on_optimizer_step(), inner(*a, **k))[1]
        corpus = prepare_corpus(cfg.data, cfg.model.vocab_size)
        self.data = TokenDataset(corpus.train_path, corpus.dtype, cfg.data.seq_len)
        self.sampler = GlobalBatchSampler(len(self.data), t.global_batch_size, cfg.run.seed, rank, world)
        self.step = 0

    def train_step(self, after_backward=None) -> float:
        """One optimizer step over the global batch; `after_backward()` runs after each micro-batch's."""
        from polytrain.optim.schedule import set_lr

        local = self.sampler.next_batch()
        mbs = self.cfg.train.micro_batch_size
        loss_sum = torch.zeros(())
        set_lr(self.optimizer, self.step, self.cfg)  # polytrain's schedule, for equal losses
        for i in range(0, len(local), mbs):
            inputs, targets = self.data.get_batch(local[i:i + mbs])
            if self.head is not None:
                with self.head.scoring(targets):
                    loss = self.engine(inputs)
            else:
                logits = self.engine(inputs)
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
            if after_backward is not None:
                after_backward()
            self.engine.step()  # the optimizer steps at the accumulation boundary only
            loss_sum += loss.detach() / self.accum
        self.step += 1
        dist.all_reduce(loss_sum)
        return loss_sum.item() / dist.get_world_size()


class PolytrainJob:
    """One rank of polytrain's Trainer (which joins the torchrun job itself)."""

    def __init__(self, cfg: Config):
        from polytrain.backend import get_accelerator
        from polytrain.distributed.world import init_world
        from polytrain.train.trainer import Trainer

        init_world(get_accelerator())  # the rss figure is taken after joining, as for DeepSpeed
        self.rss_start_kib = proc_status_kib("VmRSS")
        self.trainer = Trainer(cfg)

    def train_step(self) -> float:
        return self.trainer.train_step()["loss"]


def worker(args: argparse.Namespace) -> None:
    polytrain_only = shlex.split(args.polytrain_args) if args.worker == "polytrain" else []
    cfg = load_config(None, config_overrides(args) + [
        "--parallel.zero", str(args.zero), "--run.out_dir", str(args.out_dir),
        "--run.eval_every", "0", "--run.sample_tokens", "0"] + polytrain_only)
    job = (DeepSpeedJob(cfg, args.zero, compile_engine=args.deepspeed_compile) if args.worker == "deepspeed"
           else PolytrainJob(cfg))
    losses = [job.train_step() for _ in range(args.warmup)]
    dist.barrier()
    start = time.perf_counter()
    losses += [job.train_step() for _ in range(args.steps)]
    dist.barrier()
    seconds = time.perf_counter() - start
    record = {"rank": dist.get_rank(), "seconds": seconds, "losses": losses,
              "rss_start_kib": job.rss_start_kib, "peak_rss_kib": proc_status_kib("VmHWM")}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if dist.get_rank() == 0:
        args.result.write_text(json.dumps(gathered))
    dist.destroy_process_group()


# ----- the driver ----------------------------------------------------------------------


def launch(args: argparse.Namespace, framework: str, stage: int, work: Path, tag: str) -> dict:
    """Start one torchrun job; return tokens/s and the largest per-rank memory figures."""
    result, out = work / f"{tag}.json", work / tag
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(args.nproc), os.path.abspath(__file__),
           "--worker", framework, "--zero", str(stage), "--result", str(result),
           "--out-dir", str(out), "--size", args.size, "--seq-len", str(args.seq_len),
           "--micro-batch", str(args.micro_batch), "--global-batch", str(args.global_batch),
           "--source", args.source, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--loss", args.loss, "--precision", args.precision, "--polytrain-args", args.polytrain_args,
           *(["--deepspeed-compile"] if args.deepspeed_compile else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // args.nproc)),
           "DS_ACCELERATOR": "cpu" if torch.cuda.device_count() == 0 else
           os.environ.get("DS_ACCELERATOR", "cuda")}
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if not result.exists():  # rank 0 writes it once every rank has reported
        print(done.stdout[-4000:], done.stderr[-6000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"error: the {framework} ZeRO-{stage} job failed (exit {done.returncode})")
    if done.returncode != 0:  # measured, then crashed in shutdown (DeepSpeed's ZeRO-3 on gloo does)
        why = [line for line in done.stderr.splitlines()
               if any(word in line for word in ("Error", "error:", "Signal", "terminate", "exitcode"))]
        print(f"note: the {framework} ZeRO-{stage} job exited {done.returncode} after every rank "
              f"reported; its figures count. stderr says: {' | '.join(why[:4])[:600]}", flush=True)
    ranks = json.loads(result.read_text())
    seconds = max(r["seconds"] for r in ranks)
    tokens = args.steps * args.global_batch * args.seq_len
    return {"tokens_per_s": tokens / seconds, "seconds": seconds,
            "peak_rss_mib": max(r["peak_rss_kib"] for r in ranks) / 1024,
            "rss_start_mib": max(r["rss_start_kib"] for r in ranks) / 1024,
            "losses": ranks[0]["losses"]}


def measure(args: argparse.Namespace, stages: list[int], work: Path) -> dict:
    runs: dict[int, dict[str, list[dict]]] = {s: {f: [] for f in FRAMEWORKS} for s in stages}
    for r in range(args.rounds):
        for stage in stages:
            order = FRAMEWORKS if r % 2 == 0 else FRAMEWORKS[::-1]
            for framework in order:
                run = launch(args, framework, stage, work, f"{framework}-z{stage}-r{r}")
                runs[stage][framework].append(run)
                print(f"round {r + 1}/{args.rounds} ZeRO-{stage} {framework}: "
                      f"{run['tokens_per_s']:,.0f} tok/s, peak RSS {run['peak_rss_mib']:,.0f} MiB "
                      f"(at start {run['rss_start_mib']:,.0f}), loss {run['losses'][0]:.4f} -> "
                      f"{run['losses'][-1]:.4f}", flush=True)
    summary = {}
    for stage, per in runs.items():
        med = {f: {k: statistics.median(run[k] for run in per[f])
                   for k in ("tokens_per_s", "peak_rss_mib", "rss_start_mib")} for f in FRAMEWORKS}
        first = {f: per[f][0]["losses"] for f in FRAMEWORKS}
        # Each round's two jobs ran back to back, so their ratio cancels slow drifts of the machine.
        paired = sorted(p["tokens_per_s"] / d["tokens_per_s"] for p, d in zip(per["polytrain"], per["deepspeed"]))
        summary[stage] = {
            "median": med, "runs": per, "round_speed_ratios": paired,
            "speed_ratio": med["polytrain"]["tokens_per_s"] / med["deepspeed"]["tokens_per_s"],
            "rss_ratio": med["polytrain"]["peak_rss_mib"] / med["deepspeed"]["peak_rss_mib"],
            "loss_step1": {f: first[f][0] for f in FRAMEWORKS},
            "loss_last": {f: first[f][-1] for f in FRAMEWORKS},
        }
    return summary


def machine() -> str:
    from polytrain.backend import get_accelerator

    return get_accelerator().describe()  # names the torch version too


def report(args: argparse.Namespace, summary: dict, params: float, ds_version: str,
           load: float | None) -> str:
    load_text = f" | load average at start {load:.1f}" if load is not None else ""
    command = " ".join(["DS_ACCELERATOR=cpu python benchmarks/vs_deepspeed.py", *map(shlex.quote, sys.argv[1:])])
    lines = [
        f"Machine: {machine()}, deepspeed {ds_version} | {datetime.date.today().isoformat()}{load_text}",
        (f"Model: llama {args.size} ({params / 1e6:.1f}M parameters), seq {args.seq_len}, "
         f"micro-batch {args.micro_batch}, global batch {args.global_batch}, {args.precision} AdamW"
         f"{' (16-bit weights and gradients, fp32 masters, both)' if args.precision == 'bf16' else ''}, "
         f"{args.loss} loss, "
         f"{args.nproc} ranks x {max(1, args.threads // args.nproc)} thread(s), gloo; "
         f"median of {args.rounds} job(s) each, {args.steps} timed steps after {args.warmup}"),
        f"Command: `{command}`",
        "",
        ("| ZeRO | DeepSpeed tok/s | polytrain tok/s | speed polytrain/DS | per-round speed ratios (sorted) "
         "| DeepSpeed peak RSS | polytrain peak RSS | RSS polytrain/DS | loss step 1 DS / polytrain "
         "| loss last DS / polytrain |"),
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for stage, s in summary.items():
        ds, pt = s["median"]["deepspeed"], s["median"]["polytrain"]
        rounds = " ".join(f"{r:.2f}" for r in s["round_speed_ratios"])
        lines.append(
            f"| {stage} | {ds['tokens_per_s']:,.0f} | {pt['tokens_per_s']:,.0f} | {s['speed_ratio']:.2f} "
            f"| {rounds} "
            f"| {ds['peak_rss_mib']:,.0f} MiB | {pt['peak_rss_mib']:,.0f} MiB | {s['rss_ratio']:.2f} "
            f"| {s['loss_step1']['deepspeed']:.4f} / {s['loss_step1']['polytrain']:.4f} "
            f"| {s['loss_last']['deepspeed']:.4f} / {s['loss_last']['polytrain']:.4f} |")
    starts = ", ".join(f"ZeRO-{stage} DS {s['median']['deepspeed']['rss_start_mib']:,.0f} / "
                       f"polytrain {s['median']['polytrain']['rss_start_mib']:,.0f}"
                       for stage, s in summary.items())
    lines += ["", (f"Peak RSS is the largest VmHWM over the ranks; RSS per rank before the model "
                   f"(MiB): {starts}.")]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.worker:  # a rank of one job: it ends as polytrain's workers do (train/worker_exit.py)
        run_and_exit(lambda: worker(args) or 0)
    try:
        import deepspeed
    except ImportError:
        raise SystemExit("error: deepspeed is not installed; `DS_BUILD_OPS=0 pip install deepspeed` "
                         "(see this script's docstring)") from None
    stages = [int(s) for s in args.stages.split(",")]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is not None and load > 0.5:
        print(f"warning: load average {load:.1f} before starting; other jobs are running, so "
              "the figures will be noisy", flush=True)
    from polytrain.data import prepare_corpus
    from polytrain.models import ARCHITECTURES

    cfg = load_config(None, config_overrides(args))
    prepare_corpus(cfg.data, cfg.model.vocab_size)  # tokenize once, before the ranks race for it
    with torch.device("meta"):
        params = ARCHITECTURES["llama"].build(cfg.model).num_params()
    with tempfile.TemporaryDirectory(prefix="polytrain-vs-ds-") as tmp:
        summary = measure(args, stages, Path(tmp))
    table = report(args, summary, params, deepspeed.__version__, load)
    print("\n" + table)
    if args.json:
        record = {"machine": machine(), "deepspeed": deepspeed.__version__,
                  "date": datetime.date.today().isoformat(), "load_average": load,
                  "args": vars(args), "stages": summary, "table": table}
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
