"""A step's run directory, as `polytrain train` writes one, so every tool that reads runs reads it.

    runs/<name>/<step>/
        config.toml          the step's resolved config (its model, layout, learning rate, steps)
        tokenizer.json       the run's tokenizer (and tokenizer_config.json with the actor's chat template)
        metrics.jsonl        one row per logged step and per evaluation
        loss.png, reward.png the step's curves (rlhf/plots.py)
        checkpoints/step_<N>/  sharded checkpoints (the trainer's format: `polytrain generate`, `chat`,
                               `consolidate` and `convert --to hf` read them)
        complete.json        written last: the step is finished and skipped from then on (plan.py)

A step resumes from its newest checkpoint (checkpoint.resume = "auto") or starts afresh
("none"); its metrics rows after the checkpoint's step are dropped on resume.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from polytrain.checkpoint import Checkpointer, RunDir, TrainerState, latest_checkpoint
from polytrain.config import Config, to_toml
from polytrain.distributed.world import barrier, together
from polytrain.errors import ConfigError
from polytrain.models.registry import shape_config
from polytrain.rlhf.batches import chat_template_for
from polytrain.rlhf.context import RLHFRun
from polytrain.rlhf.plan import mark_complete, step_dir
from polytrain.rlhf.roles import RoleModel, rng_state, set_rng_state
from polytrain.train.metrics import MetricsLogger


class StepRun:
    """One step's directory: its files, checkpoints and metrics (module docstring); collective."""

    def __init__(self, run: RLHFRun, step: str, cfg: Config):
        self.run, self.step, self.cfg = run, step, cfg
        self.dir = step_dir(run.run_dir, step)
        self.files = RunDir(self.dir)
        self.main = run.world.is_main
        if cfg.checkpoint.resume not in ("auto", "none"):
            raise ConfigError(f"checkpoint.resume = {cfg.checkpoint.resume!r}: polytrain rlhf resumes each step from "
                              "its own checkpoints ('auto') or starts unfinished steps afresh ('none')")
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.files.config.write_text(to_toml(cfg))
            run.tokenizer.save(self.files.tokenizer)
            self._write_chat_template()
        barrier()
        acc = run.acc
        self.checkpointer = Checkpointer(self.dir, cfg.checkpoint.keep, lambda: rng_state(acc),
                                         lambda state: set_rng_state(acc, state))
        self.checkpointer.clear_partial()
        self.resume_from = latest_checkpoint(self.dir) if cfg.checkpoint.resume == "auto" else None

    def _write_chat_template(self) -> None:
        """tokenizer_config.json for `polytrain chat`: the actor's own, else a template that renders user turns
        as this run's prompts were rendered (batches.chat_template_for)."""
        source = self.run.actor.directory
        for extra in ((source / "hf" / "tokenizer_config.json", source / "tokenizer_config.json") if source else ()):
            if extra.is_file():
                shutil.copyfile(extra, self.dir / "tokenizer_config.json")
                return
        eot = self.run.tokenizer.hf.id_to_token(self.run.tokenizer.eot_id)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "bos_token": eot, "unk_token": eot,
                  "chat_template": chat_template_for(self.cfg.rlhf.prompt_template)}
        (self.dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")

    def state(self, step: int, sampler: dict[str, Any], role: RoleModel) -> TrainerState:
        """The trainer.json of a checkpoint at `step` of `role`'s model (the one `polytrain chat` loads)."""
        return TrainerState(step=step, sampler=sampler, optimizer=role.cfg.train.optimizer,
                            model_config=shape_config(role.cfg.model), world_size=self.run.world.world_size,
                            loss_scaler=role.scaler.state_dict() if role.scaler else None)

    def resume(self, tensors: Any, role: RoleModel) -> TrainerState | None:
        """Load the newest checkpoint into `tensors` (a strategy's or step 3's state); None when starting afresh."""
        if self.resume_from is None:
            return None
        state = self.checkpointer.load(self.resume_from, tensors, self.state(0, {}, role))
        if role.scaler is not None and state.loss_scaler is not None:
            role.scaler.load_state_dict(state.loss_scaler)
        if self.main:
            print(f"step {self.step}: resumed from {self.resume_from} at step {state.step}", flush=True)
        return state

    def metrics(self, resume_step: int | None) -> MetricsLogger:
        """The step's metrics.jsonl and run.loggers' sinks, as the run <run.name>/<step>."""
        return together(lambda: MetricsLogger(self.dir, self.main, resume_step=resume_step, cfg=self.cfg,
                                              name=f"{self.cfg.run.name}/{self.step}"))

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Mark the step complete (its last file) once every rank is done; returns the summary."""
        barrier()
        if self.main:
            mark_complete(self.run.run_dir, self.step, summary)
        barrier()
        return summary


def checkpoint_path(run_dir: Path, step: str) -> Path:
    """The final checkpoint of a finished step, or one line naming the step to rerun."""
    path = latest_checkpoint(step_dir(run_dir, step))
    if path is None:
        raise ConfigError(f"{step_dir(run_dir, step)} is marked complete but holds no checkpoint; delete the "
                          f"directory and run the step again")
    return path
