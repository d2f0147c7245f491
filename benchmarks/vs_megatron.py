"""polytrain's tensor parallelism against Megatron-Core's, tp = 2, the same GPT shape, side by side.

    python benchmarks/vs_megatron.py                        # gpt2 small shape, 5 rounds: ~10-15 min on 2 cores
    python benchmarks/vs_megatron.py --size tiny --rounds 1 --steps 2 --warmup 1   # a check that it runs
    python benchmarks/vs_megatron.py --polytrain-args "--train.chunked_loss false"
    python benchmarks/vs_megatron.py --pp 2 --micro-batch 2 --micro-batches 4   # tp 2 x pp 2, 1F1B, 4 ranks
    python benchmarks/vs_megatron.py --precision bf16      # 16-bit weights and gradients, fp32 masters, both sides

Megatron-Core (the `test` extra installs it) is written for CUDA and NCCL; its job runs
under `polytrain run --nproc 2` (polytrain's CUDA wrapper, so Megatron runs unchanged on
the CPU with gloo, as tests/compat/test_megatron.py does), polytrain's under torchrun
(it needs no wrapper; `--polytrain-under-wrapper` runs it under `polytrain run` too, to
see what the wrapper costs). Megatron's job is its own
GPTModel with the local layer spec (Megatron's column/row-parallel linears, its
vocabulary-parallel embedding and cross-entropy; its fused kernels are CUDA-only) trained
by `get_forward_backward_func`; polytrain's is `Trainer` with `--model.arch gpt2
--parallel.tp 2`. The same shape (polytrain's gpt2 preset --size: width, blocks, heads,
FFN, vocabulary; learned positions, pre-LayerNorm with biases, GPT-2's tanh GELU, tied output), sequence
length and micro-batch, one micro-batch per step, no dropout, no gradient clipping, torch's
fused AdamW with the same hyperparameters on both sides. Megatron's activation is set to
GPT-2's tanh GELU, which polytrain's gpt2 preset uses (what Megatron-LM's `--openai-gelu`
selects; its own default is the exact GELU, ~2x cheaper in bf16 on this CPU), as
`F.gelu(approximate="tanh")` on both sides. `--precision bf16` trains both in
bf16 with fp32 master weights: Megatron its own way (TransformerConfig bf16, the model in its
Float16Module, Float16OptimizerWithFloat16Params over the fused AdamW, no loss scale),
polytrain with `--train.precision bf16`. Megatron reads random tokens,
polytrain its token file (the values do not change the work).

`--pp 2` adds pipeline parallelism over 2 x tp ranks: Megatron's GPTModel split into first
and last stages (`pre_process` / `post_process`), its non-interleaved 1F1B schedule over
`--micro-batches` micro-batches, the tied word embedding's gradient all-reduced between the
two stages' copies after backward (what Megatron's finalize_model_grads does); polytrain's
`--parallel.pp 2 --parallel.pp_schedule 1f1b` at the same global batch.

--rounds rounds, who goes first swapping each round; each job trains --warmup untimed
steps, then --steps timed ones between barriers. The table gives median tokens/s, the
spread, per-round ratios and peak RSS per rank.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

FRAMEWORKS = ("megatron", "polytrain")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="polytrain gpt2 size preset (tiny, small, 124m, ...)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (the job has 2 x pp ranks)")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step (the pipeline's)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: 16-bit weights and gradients, fp32 master weights, both frameworks")
    p.add_argument("--source", default="stdlib", help="polytrain's data.source (tokenized once, cached)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads shared by a job's 2 ranks")
    p.add_argument("--polytrain-args", default="", help="extra config overrides for the polytrain jobs")
    p.add_argument("--polytrain-under-wrapper", action="store_true",
                   help="launch polytrain's jobs with `polytrain run` (the CUDA wrapper) as Megatron's")
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def shape(size: str) -> dict:
    from polytrain.models import ARCHITECTURES

    return ARCHITECTURES["gpt2"].presets[size]


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class MegatronJob:
    """One rank of Megatron-Core's GPTModel at tp 2, after Megatron-LM's simple training loop."""

    def __init__(self, args: argparse.Namespace):
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # the wrapper maps CUDA to this process's device
        torch.distributed.init_process_group(backend="nccl")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=args.pp)
        model_parallel_cuda_manual_seed(123)
        s, self.args = shape(args.size), args
        bf16 = args.precision == "bf16"
        dtype = torch.bfloat16 if bf16 else torch.float32
        config = TransformerConfig(num_layers=s["n_layers"], hidden_size=s["dim"], num_attention_heads=s["n_heads"],
                                   ffn_hidden_size=s["ffn_dim"], hidden_dropout=0.0, attention_dropout=0.0,
                                   activation_func=functools.partial(F.gelu, approximate="tanh"),
                                   use_cpu_initialization=True, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
                                   tensor_model_parallel_size=2, pipeline_model_parallel_size=args.pp)
        self.vocab = s["vocab_size"]
        self.gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                            vocab_size=self.vocab, max_sequence_length=args.seq_len,
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage()).cuda()
        self.model = Float16Module(config, self.gpt) if bf16 else self.gpt
        # The first and last stages each hold the tied word embedding (input table, output layer).
        self.embedding_group = parallel_state.get_embedding_group() if args.pp > 1 else None
        self.holds_embedding = (self.embedding_group is not None and torch.distributed.get_rank()
                                in torch.distributed.get_process_group_ranks(self.embedding_group))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                           weight_decay=0.1, fused=True)
        if bf16:  # fp32 masters of the bf16 weights; the inner AdamW steps the masters
            self.optimizer = Float16OptimizerWithFloat16Params(
                self.optimizer, OptimizerConfig(bf16=True, clip_grad=0.0, lr=3e-4, weight_decay=0.1),
                grad_scaler=None, init_state_fn=None)
        self.forward_backward = get_forward_backward_func()
        self.generator = torch.Generator().manual_seed(1234)

    def batches(self):
        B, T = self.args.micro_batch, self.args.seq_len
        while True:
            tokens = torch.randint(0, self.vocab, (B, T + 1), generator=self.generator)
            yield {"tokens": tokens[:, :-1].cuda(), "labels": tokens[:, 1:].cuda(),
                   "position_ids": torch.arange(T).expand(B, T).cuda(),
                   "attention_mask": torch.ones(1, 1, T, T, dtype=torch.bool).tril().logical_not().cuda()}

    def train_step(self, data) -> float:
        def forward_step(iterator, model):
            batch = next(iterator)
            out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

            def loss_func(losses):
                loss = losses.float().mean()
                return loss, {"lm loss": loss}

            return out, loss_func

        self.optimizer.zero_grad(set_to_none=True)
        T = self.args.seq_len
        reduced = self.forward_backward(forward_step_func=forward_step, data_iterator=data, model=self.model,
                                        num_microbatches=self.args.micro_batches, seq_length=T,
                                        micro_batch_size=self.args.micro_batch, decoder_seq_length=T,
                                        forward_only=False)
        if self.holds_embedding:  # the two copies' gradients summed, as finalize_model_grads does
            grad = self.gpt.shared_embedding_or_output_weight().grad
            torch.distributed.all_reduce(grad, group=self.embedding_group)
        self.optimizer.step()
        # The loss is known on the last stage only.
        return sum(r["lm loss"].item() for r in reduced) / len(reduced) if reduced else float("nan")


class PolytrainJob:
    def __init__(self, args: argparse.Namespace):
        from polytrain.config import load_config
        from polytrain.train.trainer import Trainer  # it joins the job torchrun describes

        overrides = ["--model.arch", "gpt2", "--model.size", args.size, "--parallel.tp", "2",
                     "--parallel.pp", str(args.pp), "--parallel.pp_schedule", "1f1b",
                     "--data.source", args.source, "--data.seq_len", str(args.seq_len),
                     "--train.micro_batch_size", str(args.micro_batch),
                     "--train.global_batch_size", str(args.micro_batch * args.micro_batches),
                     "--train.grad_clip", "0", "--train.precision", args.precision,
                     "--train.lr", "3e-4", "--train.warmup_steps", "0", "--model.max_seq_len", str(args.seq_len),
                     "--run.steps", str(args.warmup + args.steps),
                     "--run.out_dir", str(args.out_dir), "--checkpoint.resume", "none",
                     *shlex.split(args.polytrain_args)]
        self.trainer = Trainer(load_config(None, overrides))

    def batches(self):
        return None

    def train_step(self, _data) -> float:
        return self.trainer.train_step()["loss"]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    job = MegatronJob(args) if args.worker == "megatron" else PolytrainJob(args)
    data = job.batches()
    for _ in range(args.warmup):
        job.train_step(data)
    dist.barrier()
    start = time.perf_counter()
    losses = [job.train_step(data) for _ in range(args.steps)]
    dist.barrier()
    record = {"seconds": time.perf_counter() - start, "losses": losses, "peak_rss_mib": peak_rss_mib()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if dist.get_rank() == 0:
        args.result.write_text(json.dumps(gathered))
    dist.destroy_process_group()


def launch(args: argparse.Namespace, framework: str, work: Path, tag: str) -> dict:
    result = work / f"{tag}.json"
    wrapped = framework == "megatron" or args.polytrain_under_wrapper
    nproc = 2 * args.pp
    launcher = (["-m", "polytrain.cli", "run", "--nproc", str(nproc)] if wrapped else
                ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)])
    cmd = [sys.executable, *launcher, os.path.abspath(__file__),
           "--worker", framework, "--result", str(result), "--out-dir", str(work / tag), "--size", args.size,
           "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--source", args.source,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--polytrain-args", args.polytrain_args,
           "--pp", str(args.pp), "--micro-batches", str(args.micro_batches), "--precision", args.precision]
    if args.polytrain_under_wrapper:
        cmd.append("--polytrain-under-wrapper")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // nproc))}
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if not result.exists():
        print(done.stdout[-4000:], done.stderr[-6000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"error: the {framework} job failed (exit {done.returncode})")
    ranks = json.loads(result.read_text())
    seconds = max(r["seconds"] for r in ranks)
    losses = next((r["losses"] for r in ranks if not any(map(math.isnan, r["losses"]))), ranks[-1]["losses"])
    return {"tokens_per_s": args.steps * args.micro_batches * args.micro_batch * args.seq_len / seconds,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks), "losses": losses}


def main() -> None:
    args = parse_args()
    if args.worker:  # a rank of one job: it ends as polytrain's workers do (train/worker_exit.py)
        from polytrain.train.worker_exit import run_and_exit

        run_and_exit(lambda: worker(args) or 0)
    import megatron.core

    from polytrain.backend import get_accelerator
    from polytrain.config import load_config
    from polytrain.data import prepare_corpus

    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f} before starting; the figures will be noisy", flush=True)
    cfg = load_config(None, ["--model.arch", "gpt2", "--model.size", args.size, "--data.source", args.source])
    prepare_corpus(cfg.data, cfg.model.vocab_size)  # tokenize once, before the ranks race for it
    runs = {f: [] for f in FRAMEWORKS}
    with tempfile.TemporaryDirectory(prefix="polytrain-vs-megatron-") as tmp:
        for r in range(args.rounds):
            for framework in (FRAMEWORKS if r % 2 == 0 else FRAMEWORKS[::-1]):
                run = launch(args, framework, Path(tmp), f"{framework}-r{r}")
                runs[framework].append(run)
                print(f"round {r + 1}/{args.rounds} {framework}: {run['tokens_per_s']:,.0f} tok/s, peak RSS "
                      f"{run['peak_rss_mib']:,.0f} MiB", flush=True)
    med = {f: statistics.median(run["tokens_per_s"] for run in runs[f]) for f in FRAMEWORKS}
    rss = {f: statistics.median(run["peak_rss_mib"] for run in runs[f]) for f in FRAMEWORKS}
    ratios = sorted(p["tokens_per_s"] / m["tokens_per_s"] for p, m in zip(runs["polytrain"], runs["megatron"]))
    s = shape(args.size)
    lines = [f"{datetime.date.today()}, {get_accelerator().describe()}, megatron-core {megatron.core.__version__}, "
             f"load average at start {load:.1f}",
             f"`python benchmarks/vs_megatron.py {' '.join(map(shlex.quote, sys.argv[1:]))}`: gpt2 {args.size} "
             f"(dim {s['dim']}, {s['n_layers']} blocks, vocab {s['vocab_size']}), tp 2"
             f"{f' x pp {args.pp} (1F1B)' if args.pp > 1 else ''}, seq {args.seq_len}, "
             f"micro-batch {args.micro_batch} x {args.micro_batches}, {args.precision}, {args.rounds} rounds x {args.steps} steps after {args.warmup}",
             "", "| framework | tokens/s (median) | spread | peak RSS MiB | polytrain/Megatron (per-round) |",
             "| --- | ---: | ---: | ---: | --- |"]
    for f in FRAMEWORKS:
        rates = [run["tokens_per_s"] for run in runs[f]]
        ratio = (f"**{med['polytrain'] / med['megatron']:.2f}x** ({' '.join(f'{x:.2f}' for x in ratios)})"
                 if f == "polytrain" else "")
        lines.append(f"| {f} | {med[f]:,.0f} | {min(rates):,.0f}-{max(rates):,.0f} | {rss[f]:,.0f} | {ratio} |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "runs": runs, "table": table}, indent=1, default=str))


if __name__ == "__main__":
    main()
