"""The training loop: start-up check -> runtime -> model builder -> data -> steps -> checkpoints.

One `Trainer` runs on every rank. A step reads this rank's share of the global
batch, runs it as micro-batches with gradient accumulation, clips the gradient by
its true global norm, and steps the optimizer; every `log_every` steps rank 0
writes a metrics row and redraws the progress bar.

    trainer = Trainer(load_config(None, ["--run.steps", "50"]))
    summary = trainer.train()
"""

from __future__ import annotations

import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from polytrain.checkpoint import (
    Checkpointer,
    RunDir,
    TrainerState,
    check_checkpoint,
    latest_checkpoint,
)
from polytrain.config import Config, to_toml
from polytrain.data import GlobalBatchSampler, TokenDataset, val_batches
from polytrain.data.batch_schedule import BatchSchedule
from polytrain.data.blended import training_windows
from polytrain.data.needle import PasskeyDataset
from polytrain.data.objectives import build_objective, reserved_ids
from polytrain.distributed.context_parallel.apply import ShardedData
from polytrain.distributed.watchdog import Watchdog, hang_directory
from polytrain.distributed.world import barrier, max_over_world, mean_over_world, together
from polytrain.errors import ConfigError, TrainingDiverged
from polytrain.inference.cp_generate import generate_cp
from polytrain.inference.generate import generate
from polytrain.lora import lora_record
from polytrain.models.registry import shape_config
from polytrain.optim.builder import restart_state
from polytrain.optim.schedule import scheduled_lr, set_lr
from polytrain.train.build import AUTOCAST, build_model
from polytrain.train.elastic_launch import ELASTIC_ENV, record_event
from polytrain.train.faults import inject_faults
from polytrain.train.loggers import require_loggers
from polytrain.train.metrics import MetricsLogger, plot_loss
from polytrain.train.mfu import MFU, gemm_dtype
from polytrain.train.precision import LossScaler, check_fp16_autocast
from polytrain.train.progress import ProgressBar
from polytrain.train.snapshot import newest_resume_point, snapshot_dir, snapshots_possible
from polytrain.train.startup import start

SAMPLE_PROMPT = "def "
PLOT_INTERVAL_S = 15.0


class Trainer:
    """Builds everything a run needs from a validated Config, on every rank."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        require_loggers(cfg)  # a missing wandb/mlflow fails now, not at the first logged step
        self.runtime, self.layout = start(cfg)  # the job joined, the layout checked, the mesh built
        self.acc, self.world, self.dims = self.runtime.acc, self.runtime.world, self.runtime.dims
        self.device = self.runtime.device
        self.batch = self.layout.batch  # micro-batch size, accumulation steps, dp: read, never re-derived
        self.run_dir = cfg.run_dir
        self.resume_from = self._resume_path()

        torch.manual_seed(cfg.run.seed)
        self.acc.manual_seed(cfg.run.seed)
        self.corpus = self._prepare_corpus()
        self.tokenizer = self.corpus.tokenizer
        # What the model reads and the loss scores: causal LM, BERT's masked LM or T5's span corruption.
        self.objective = build_objective(cfg, self.tokenizer)
        self.autocast_dtype = AUTOCAST[cfg.train.precision]
        built = build_model(self.runtime, cfg, self.layout.pipeline, run_dir=self.run_dir,
                            eot_id=self.tokenizer.eot_id)
        self.model, self.dp, self.loss, self.pipeline = built.model, built.dp, built.loss, built.pipeline
        self.cp = built.cp
        self.num_params, self.flops_per_token = built.num_params, built.flops_per_token
        self.compile_timer = built.compile_timer  # train.compile: reported after the first step
        self.num_adapter_params = built.num_adapter_params
        self.fp32_attention = built.fp32_attention
        self.fp32_matmuls = built.fp32_matmuls
        self.host_attention = built.host_attention
        self.onednn_products = built.onednn_products
        # Adapters-only checkpoints name where their frozen base comes from (set again on loading).
        lo = cfg.lora
        self.base = f"init:{cfg.run.seed}" if lo.rank and lo.only_optimize else None
        # The optimizer whose param_groups carry the learning rate (ZeRO: the one over master shards).
        self.optimizer = self.dp.build_optimizer(self.model, cfg.train)
        seq_len = cfg.data.seq_len
        self.train_data, self.val_data = self._datasets(seq_len)
        rt = self.runtime
        self.sampler = GlobalBatchSampler(len(self.train_data), self.batch.global_batch_size, cfg.run.seed,
                                          rt.dp_rank, rt.dp_size)
        # eval_batches global batches: the same sequences whatever the layout, so
        # validation losses of different layouts compare directly.
        self.val_indices = val_batches(self.val_data, self.batch.micro_batch_size,
                                       cfg.run.eval_batches * self.batch.accum_steps, rt.dp_rank, rt.dp_size)
        # The global batch of each step, by samples consumed (constant unless it ramps up).
        self.batch_schedule = BatchSchedule.from_config(cfg.train)
        self.scaler = self._loss_scaler()
        # Offloaded states already live in host memory or files: staging would copy them again.
        async_save = cfg.checkpoint.async_save and cfg.parallel.offload == cfg.parallel.offload_params == "none"
        self.checkpointer = Checkpointer(self.run_dir, cfg.checkpoint.keep, self._rng_state, self._set_rng_state,
                                         async_save=async_save)
        self.step = 0  # batches trained, skipped fp16 steps included (DeepSpeed's global_steps)
        self.optimizer_steps = 0  # updates applied: the lr schedule's position (skips hold it, as in DeepSpeed)
        self.snapshots: Checkpointer | None = None  # made at the first snapshot, once the run directory exists
        if self.resume_from is not None:
            self.step = self._load(self.resume_from)
        # Ranks that wait for each other can hang; one process cannot (nor restart to any avail).
        self.watchdog = Watchdog(hang_directory(self.run_dir), cfg.run.hang_timeout_s if
                                 self.world.world_size > 1 else -1.0,
                                 backend_recorder=self.acc.dump_flight_recorder)  # NCCL's, on GPUs
        # `together`: a logger that fails to start on rank 0 stops every rank with its one line.
        self.metrics = together(lambda: MetricsLogger(self.run_dir, self.world.is_main,
                                                      resume_step=self.step if self.resume_from else None,
                                                      cfg=cfg))

    # ----- set-up -------------------------------------------------------------------

    def _resume_path(self) -> Path | None:
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            return None
        if resume == "auto":
            return newest_resume_point(self.run_dir)
        check_checkpoint(Path(resume))
        return Path(resume)

    def _prepare_corpus(self):
        # Rank 0 trains the tokenizer and tokenizes once; the others then hit the cache.
        # `together`: a bad input on one rank stops every rank with its one-line message.
        run = RunDir(self.run_dir)

        def on_main():
            corpus = training_windows(self.cfg.data, self._tokenizer_vocab(), self.cfg.run.seed)
            try:
                run.path.mkdir(parents=True, exist_ok=True)
                run.config.write_text(to_toml(self.cfg))
            except OSError as e:
                raise ConfigError(f"cannot write the run directory {run.path} ({e.strerror}); set "
                                  "run.out_dir (or run.name) to a directory you can write") from None
            corpus.tokenizer.save(run.tokenizer)
            return corpus

        main = self.world.is_main
        ours = together(on_main if main else None)
        theirs = together(None if main else lambda: training_windows(
            self.cfg.data, self._tokenizer_vocab(), self.cfg.run.seed))
        return ours if main else theirs

    def _datasets(self, seq_len: int):
        """(train, validation) windows: the corpus's tokens, or pass-key retrieval over its text
        (data.task); under pipeline and context parallelism they come out as this rank's shard."""
        d = self.cfg.data
        if d.task == "passkey":
            score = d.passkey_score
            train = PasskeyDataset(self.tokenizer, seq_len, self.cfg.run.seed, source=d.source, score=score)
            val = PasskeyDataset(self.tokenizer, seq_len, self.cfg.run.seed + 1, source=d.source, score=score)
        else:  # one corpus, or a blend (data.sources), in windows of data.seq_len
            train, val = self.corpus.train, self.corpus.val
        if self.pipeline is not None and self.cp is not None:  # the runner reads its batches itself
            eot = self.tokenizer.eot_id if d.packed_documents else None
            train, val = ShardedData(train, self.cp, eot), ShardedData(val, self.cp, eot)
        return train, val

    def _tokenizer_vocab(self) -> int:
        # The objective's special ids ([MASK], T5's sentinels) take the top of the model's vocabulary.
        return self.cfg.model.vocab_size - reserved_ids(self.cfg)

    def _loss_scaler(self) -> LossScaler | None:
        """fp16 only: gradients are computed for loss x scale so small ones survive fp16."""
        t = self.cfg.train
        if t.precision != "fp16":
            return None
        check_fp16_autocast(self.acc)
        return LossScaler(loss_scale=t.loss_scale, initial_scale_power=t.initial_scale_power,
                          loss_scale_window=t.loss_scale_window, hysteresis=t.hysteresis,
                          min_loss_scale=t.min_loss_scale, device=self.device)

    def _rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "device": self.acc.get_rng_state(), "python": random.getstate()}

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if state["device"] is not None:
            self.acc.set_rng_state(state["device"])
        random.setstate(state["python"])

    def _load(self, path: Path) -> int:
        # Hyperparameters come from this run's config, not the checkpoint's
        # (loading optimizer state would otherwise bring back the old lr, betas, decay).
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        state = self.checkpointer.load(path, self.dp, self._trainer_state(), seed=self.cfg.run.seed)
        for group, values in zip(self.optimizer.param_groups, hyper):
            group.update(values)
        if self.base is not None:
            # The base weights now in the model: those of `path`'s base, or of `path` itself.
            self.base = state.base if state.adapters_only else str(path.resolve())
        if state.weights_only:  # an imported model: its weights, then a fresh run from step 0
            restart_state(self.optimizer)  # loading made optimizer state at step 1; Adam's t starts at 0
            if self.world.is_main:
                print(f"initialised from the weights of {path}", flush=True)
            return 0
        self.sampler.load_state_dict(state.sampler)
        self.optimizer_steps = state.applied_steps()
        saved_batch = state.sampler["global_batch_size"]
        if saved_batch != self.sampler.global_batch_size and self.world.is_main:
            print(f"the checkpoint's global batch was {saved_batch}, now {self.sampler.global_batch_size}: "
                  f"the data continues at sample {self.sampler.consumed}", flush=True)
        if self.scaler is not None and state.loss_scaler is not None:
            self.scaler.load_state_dict(state.loss_scaler)
        if self.world.is_main:
            print(f"resumed from {path} at step {state.step}", flush=True)
        return state.step

    def _trainer_state(self) -> TrainerState:
        return TrainerState(
            step=self.step, optimizer_steps=self.optimizer_steps, sampler=self.sampler.state_dict(),
            optimizer=self.cfg.train.optimizer, model_config=shape_config(self.cfg.model),
            world_size=self.world.world_size,
            loss_scaler=self.scaler.state_dict() if self.scaler else None,
            lora=lora_record(self.cfg.lora), base=self.base,
        )

    def save(self) -> Path:
        return self.checkpointer.save(self.dp, self._trainer_state())

    def snapshot(self) -> Path | None:
        """A checkpoint into host memory (train/snapshot.py); None where ranks span machines."""
        if not snapshots_possible():
            return None
        if self.snapshots is None:
            self.snapshots = Checkpointer(snapshot_dir(self.run_dir), 1, self._rng_state, self._set_rng_state)
        return self.snapshots.save(self.dp, self._trainer_state())

    # ----- one step -----------------------------------------------------------------

    def _loss(self, indices: list[int], data: TokenDataset) -> torch.Tensor:
        inputs, targets = data.get_batch(indices)  # (B, T) each
        args, targets = self.objective.batch(inputs, targets, indices)  # model inputs; -100 = not scored
        args = [a.to(self.device, non_blocking=True) for a in args]
        targets = targets.to(self.device, non_blocking=True)
        with self.acc.autocast(self.autocast_dtype):
            return self.loss(self.model, args, targets)

    def _forward_backward(self, micro_batches: list[list[int]]) -> float:
        """Accumulate the gradients of the step's micro-batches; returns the step's mean loss (all ranks)."""
        scale = self.scaler.scale_loss if self.scaler else None
        if self.pipeline is not None:
            loss_sum = self.pipeline.train_step(micro_batches, self.train_data, self.loss.logits_loss, scale)
            return self.pipeline.mean_loss(loss_sum)
        loss_sum = torch.zeros((), device=self.device)
        for i, indices in enumerate(micro_batches):
            self.dp.before_micro_batch(self.model, last=i == len(micro_batches) - 1)
            # Every micro-batch has the same token count, so the mean of the
            # micro-batch means (and, after the data-parallel gradient average,
            # of the ranks' means) is the mean over the whole global batch.
            loss = self._loss(indices, self.train_data) / len(micro_batches)
            (scale(loss) if scale else loss).backward()
            loss_sum += loss.detach()
        return mean_over_world(loss_sum).item()

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns the step's loss, grad norm and lr."""
        self.model.train()
        inject_faults(self.world.rank, self.step + 1)  # tests only: hang, die or raise as asked
        size = self.batch_schedule.at(self.sampler.consumed)
        local = self.sampler.next_batch(size)  # this rank's size / dp sample indices
        loss_value = self._forward_backward(self.batch.micro_batches(local))
        stats = {"loss": loss_value, "global_batch": size}
        if self.scaler is not None:
            stats["loss_scale"] = self.scaler.scale
            # An fp16 overflow on any rank skips the step everywhere and lowers the scale.
            # Neither the lr schedule nor the optimizer's own step count advances (DeepSpeed's rule).
            if self.scaler.unscale_and_check(self.dp.gradients(), max_over_world):
                self.dp.zero_grad()
                self.scaler.update(found_inf=True)
                self.step += 1
                # "lr": the rate this step would have run at, which the next applied step takes.
                return {**stats, "grad_norm": None, "lr": scheduled_lr(self.optimizer_steps, self.cfg),
                        "skipped_steps": self.scaler.skipped_steps, "optimizer_steps": self.optimizer_steps}
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else math.inf
        grad_norm_value = self.dp.clip_grad_norm_(clip)
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm_value)):
            self.dp.zero_grad()
            latest = latest_checkpoint(self.run_dir)
            raise TrainingDiverged(
                f"loss is {loss_value} (grad norm {grad_norm_value}) at step {self.step + 1}; the "
                f"step was not applied and nothing was saved from it; newest checkpoint: "
                f"{latest or 'none'}; lower train.lr (now {self.cfg.train.lr}) or raise "
                f"train.warmup_steps, then rerun to resume"
            )
        lr = set_lr(self.optimizer, self.optimizer_steps, self.cfg)
        self.dp.step()
        self.dp.zero_grad()
        self.step += 1
        self.optimizer_steps += 1
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
            stats |= {"skipped_steps": self.scaler.skipped_steps, "optimizer_steps": self.optimizer_steps}
        return {**stats, "grad_norm": grad_norm_value, "lr": lr}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation batches of all ranks."""
        self.model.eval()
        if self.pipeline is not None:
            return self.pipeline.evaluate(self.val_indices, self.val_data, self.loss.logits_loss)
        total = torch.zeros((), device=self.device)
        for indices in self.val_indices:
            total += self._loss(indices, self.val_data)
        return mean_over_world(total / max(1, len(self.val_indices))).item()

    def sample(self, prompt: str = SAMPLE_PROMPT) -> str:
        """Text generated from `prompt` (all ranks run it: sharded models gather collectively)."""
        ids = self.tokenizer.encode(prompt)
        sampling = dict(temperature=0.8, top_k=40, stop_tokens={self.tokenizer.eot_id},
                        generator=torch.Generator(device=self.device).manual_seed(self.cfg.run.seed))
        if self.cp is not None and self.cp.groups.size > 1:  # the KV cache sharded like the training sequences
            return prompt + self.tokenizer.decode(generate_cp(self.model, self.cp, ids, self.cfg.run.sample_tokens,
                                                              **sampling))
        new = generate(self.model, [ids], self.cfg.run.sample_tokens, **sampling)
        return prompt + self.tokenizer.decode(new[0])

    # ----- the loop -----------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Train to `run.steps`, logging, evaluating and checkpointing; returns a summary."""
        cfg, main = self.cfg, self.world.is_main
        self.checkpointer.clear_partial()
        if main:
            print(self.describe(), flush=True)
        # Every rank logs MFU, and a measured peak is timed (~1 s a rank, one at a time under a host-wide
        # lock, until it settled in the cache): here, before the barrier, not at the first log, where a
        # rank still timing would look hung to the others' step watchdogs.
        mfu = self._mfu_meter()
        if main:
            print(mfu.describe(), flush=True)
        barrier()
        bar = ProgressBar(cfg.run.steps, self.step, enabled=main)
        start = last_log_time = last_plot = time.perf_counter()
        last_log_tokens = self.sampler.consumed * cfg.data.seq_len
        first_val = last_val = None
        saved_step = self.step if self.resume_from else None
        first_step, elastic = self.step, cfg.parallel.elastic or os.environ.get(ELASTIC_ENV) == "1"
        if os.environ.get(ELASTIC_ENV) == "1":  # the local launcher's workers: which device each ran on
            record_event(self.run_dir, "worker", attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                         rank=self.world.rank, local_rank=self.world.local_rank,
                         visible_devices=os.environ.get(self.acc.visible_devices_env))
        if self.step == 0:
            first_val = last_val = self.evaluate()
            self.metrics.log({"step": 0, "val_loss": last_val, "time": 0.0})
        try:
            while self.step < cfg.run.steps:
                with self.watchdog.watch("step", self.step + 1):
                    stats = self.train_step()
                step = self.step
                if self.compile_timer is not None and step == first_step + 1 and main:
                    bar.write(self.compile_timer.describe())  # the first step compiled the blocks
                if step % cfg.run.log_every == 0 or step == cfg.run.steps:
                    self.acc.synchronize()
                    now = time.perf_counter()
                    tokens = self.sampler.consumed * cfg.data.seq_len
                    tokens_per_s = (tokens - last_log_tokens) / (now - last_log_time)
                    last_log_time, last_log_tokens = now, tokens
                    mem = self.acc.memory_stats()
                    utilization, note = mfu.of(tokens_per_s * self.flops_per_token / self.world.world_size)
                    if note:
                        bar.write(note)
                    row = {"step": step, **stats, "tokens": tokens,
                           "tokens_per_s": tokens_per_s, "mfu": utilization,
                           "mem_gb": mem["allocated_gb"], "peak_mem_gb": mem["peak_gb"],
                           "time": now - start}
                    self.metrics.log(row)
                    bar.update(step, stats["loss"], tokens_per_s, row["mfu"], mem["allocated_gb"])
                if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step != cfg.run.steps:
                    with self.watchdog.watch("evaluation", step):
                        last_val = self.evaluate()
                    self.metrics.log({"step": step, "val_loss": last_val, "time": time.perf_counter() - start})
                    bar.write(f"step {step}: val loss {last_val:.4f}")
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                    with self.watchdog.watch("checkpoint", step):
                        self.save()
                    saved_step = step
                elif cfg.checkpoint.snapshot_every and step % cfg.checkpoint.snapshot_every == 0:
                    with self.watchdog.watch("checkpoint", step):
                        self.snapshot()
                if elastic and main and step == first_step + 1:  # training again after a (re)start
                    record_event(self.run_dir, "training", step=step, world=self.world.world_size)
                if main and time.perf_counter() - last_plot > PLOT_INTERVAL_S:
                    plot_loss(self.run_dir)
                    last_plot = time.perf_counter()
        finally:
            bar.close()
        last_val = self.evaluate()
        self.metrics.log({"step": self.step, "val_loss": last_val, "time": time.perf_counter() - start})
        checkpoint = self.save() if saved_step != self.step else None
        with self.watchdog.watch("checkpoint", self.step):
            self.checkpointer.wait()  # the run ends with its checkpoints on disk, or their error
        checkpoint = checkpoint or latest_checkpoint(self.run_dir)
        if cfg.checkpoint.snapshot_every and main:  # the run is complete on disk: its RAM snapshots go
            shutil.rmtree(snapshot_dir(self.run_dir), ignore_errors=True)
        # Generation runs on one process under pipelines and tp grids (whose ranks each
        # hold other sequences); the checkpoint loads there. Masked-LM and span objectives
        # have no text sample.
        can_sample = self.objective.name == "causal"
        one_process = self.pipeline is not None or self.dims.tp_mode != "1d" and self.dims.tp > 1
        sample = self.sample() if cfg.run.sample_tokens > 0 and can_sample and not one_process else ""
        if cfg.run.sample_tokens > 0 and can_sample and one_process and main:
            print(f"no text sample under pipeline parallelism or tp_mode {self.dims.tp_mode} (generation "
                  f"runs on one process): polytrain generate {self.run_dir}", flush=True)
        if main:
            plot_loss(self.run_dir)
        self.close()
        return {"step": self.step, "first_val_loss": first_val, "val_loss": last_val,
                "checkpoint": str(checkpoint) if checkpoint else None, "sample": sample,
                "time_s": time.perf_counter() - start}

    def close(self) -> None:
        """Release what outlives the loop: offload files, gradient hooks, open metrics files."""
        self.dp.close()
        self.watchdog.close()
        self.metrics.close()

    def describe(self) -> str:
        """Two lines on what this run is: model, layout, device, batch."""
        m, t, d = self.cfg.model, self.cfg.train, self.dims
        layout = f"{d.world_size} process(es): " + "".join(
            f"{name} {n} x " for name, n in (("pp", d.pp), (f"tp {d.tp_mode}", d.tp), (self._cp_name(), d.cp))
            if n > 1) + f"dp {d.dp}" + (
            " (sequence parallel)" if d.sp else "") + (
            f", ZeRO-{d.zero} over {d.dp_shard}" if d.zero else "") + (
            f" (x{d.dp_replicate} replicas)" if d.zero == 3 else "")
        if self.pipeline is not None:
            plan = self.pipeline.plan
            layout += (f" | pipeline {plan.schedule}: {plan.num_stages} stages, {plan.microbatches} "
                       f"micro-batches x {plan.runs} run(s) per step")
        lo = self.cfg.lora
        adapters = (f" + LoRA r={lo.rank}: {self.num_adapter_params / 1e6:.2f}M"
                    f"{' trained, base frozen' if lo.only_optimize else ''}") if lo.rank else ""
        # parallel.reduce_bucket_auto: the size ZeRO-1/2 measured (a pipeline has a strategy per stage)
        strategies = getattr(self.dp, "strategies", {0: self.dp}).values()
        choices = [getattr(strategy, "bucket_choice", None) for strategy in strategies]
        buckets = "".join(f" | {choice.describe()}" for choice in choices if choice is not None)
        return (f"model {m.arch} {m.size}: {self.num_params / 1e6:.1f}M parameters{adapters} | {layout}{buckets} | "
                f"{self.acc.describe()}\n"
                f"global batch {t.global_batch_size} x {self.cfg.data.seq_len} tokens "
                f"({t.micro_batch_size} per micro-batch, {self.batch.accum_steps} accumulation steps"
                + (f"; ramped up from {t.batch_rampup_start} by {t.batch_rampup_increment} over "
                   f"{t.batch_rampup_samples} samples" if self.batch_schedule.ramps else "") + ") | "
                f"{self.cfg.run.steps} steps | {self.cfg.train.precision}"
                + (" (attention on the host flash kernel)" if self.host_attention else
                   " (attention core in fp32)" if self.fp32_attention else "")
                + (" (products as fp32 GEMMs)" if self.fp32_matmuls else "")
                + (" (products on oneDNN)" if self.onednn_products else "") + f" | run dir {self.run_dir}")

    def _cp_name(self) -> str:
        d = self.dims
        return f"cp {d.cp_mode}" + (f" ({d.cp_ulysses} Ulysses x {d.cp // d.cp_ulysses} ring)"
                                    if d.cp_mode == "hybrid" else "")

    def _mfu_meter(self) -> MFU:
        """MFU against the peak of the GEMMs that run."""
        return MFU(self.acc.peak(gemm_dtype(self.autocast_dtype, self.fp32_matmuls)))


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = [f"trained to step {summary['step']} in {summary['time_s']:.0f}s"]
    if summary["first_val_loss"] is not None:
        lines.append(f"validation loss {summary['first_val_loss']:.3f} -> {summary['val_loss']:.3f}")
    else:
        lines.append(f"validation loss {summary['val_loss']:.3f}")
    if summary["checkpoint"]:
        lines.append(f"checkpoint: {summary['checkpoint']}")
    if summary["sample"]:
        lines.append("sample:\n" + summary["sample"])
    return lines

