"""Step 3: PPO or GRPO against the reward model (runs/<name>/ppo), the final actor.

The actor and the frozen reference start from step 1's actor, the critic (PPO) and the
frozen reward model from step 2's; each is built with its own layout (roles.py). A step
samples rlhf.group_size responses (GRPO; 1 for PPO) to global_batch_size / group_size of
step 3's prompts and trains on them for rlhf.ppo_epochs passes of rlhf.ppo_mini_batches
mini-batches (ppo_engine.py). Per logged step metrics.jsonl
holds `reward` (the reward model's clipped score), `kl` (log pi - log pi_ref summed over a
response), `policy_loss`, `value_loss` (PPO), `clip_frac`, `entropy`, `response_len` and
`task_score`, the true metric of the built-in task (null for a user's data) that shows
reward hacking the reward model's score hides, and the step's cost: `time_generate`,
`time_experience`, `time_train` (seconds), `gen_tokens_per_s` and each phase's `peak_gb_*`;
every run.eval_every steps and at both ends the held-out prompts give `eval_reward` and
`eval_task_score`. reward.png draws them.

The rollout samples through the Hybrid Engine (rlhf.hybrid_engine, default; rollout.py),
else through the actor's training layout: the same tokens either way. rlhf.offload_reference
and rlhf.offload_reward keep those frozen models in host memory between their passes
(offload.py).

The checkpoint holds the actor under `model` (so `polytrain chat`, `generate`,
`consolidate` and `convert --to hf` read it as any run's model), the critic under
`critic`, the EMA actor under `ema`; with rlhf.ema the EMA actor is also written as its
own run directory, runs/<name>/ppo/ema.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from polytrain.checkpoint import RunDir, save_weights
from polytrain.config import Config, ModelConfig, RLHFConfig, to_toml
from polytrain.data import GlobalBatchSampler
from polytrain.distributed.world import barrier
from polytrain.errors import ConfigError
from polytrain.distributed.tensor_parallel.checks import valid_tp_degrees
from polytrain.inference.hybrid_engine import HybridEngine
from polytrain.inference.load import stop_tokens
from polytrain.models import ARCHITECTURES
from polytrain.models.registry import shape_config
from polytrain.rlhf.context import RLHFRun
from polytrain.rlhf.plan import step_dir
from polytrain.rlhf.plots import plot_panels
from polytrain.rlhf.ppo_engine import PPOEngine
from polytrain.rlhf.roles import RoleModel, build_role, role_config, role_layout
from polytrain.rlhf.rollout import (
    Generation,
    HybridEngineGeneration,
    Rollout,
    Sampling,
    TrainingLayoutGeneration,
)
from polytrain.rlhf.reward import trained_reward_model
from polytrain.rlhf.sft import lm_loss_of_batch
from polytrain.rlhf.sources import Start
from polytrain.rlhf.stepdir import StepRun, checkpoint_path
from polytrain.train.metrics import plot_loss


def step3_configs(cfg: Config, run_dir: Path, actor: ModelConfig, reward: ModelConfig) -> dict[str, Config]:
    """The four models' configs: the actor's (which is step 3's config.toml), reference, reward, critic."""
    r = cfg.rlhf
    steps = r.ppo_steps or cfg.run.steps
    _check(cfg, actor, reward)
    configs = {
        "actor": role_config(cfg, "actor", actor, lr=r.actor_lr or cfg.train.lr, steps=steps),
        "reference": role_config(cfg, "reference", actor, lr=cfg.train.lr, steps=steps, frozen=True),
        "reward": role_config(cfg, "reward", reward, lr=cfg.train.lr, steps=steps, frozen=True),
    }
    if r.algorithm == "ppo":
        configs["critic"] = role_config(cfg, "critic", reward, lr=r.critic_lr or cfg.train.lr, steps=steps)
    actor_run = dataclasses.replace(configs["actor"].run, out_dir=str(step_dir(run_dir, "ppo")))
    configs["actor"] = dataclasses.replace(configs["actor"], run=actor_run)
    return configs


def _check(cfg: Config, actor: ModelConfig, reward: ModelConfig) -> None:
    r = cfg.rlhf
    longest = r.max_prompt_len + r.max_new_tokens
    for name, model in (("actor", actor), ("reward model", reward)):
        if longest > model.max_seq_len:
            raise ConfigError(f"rlhf.max_prompt_len + rlhf.max_new_tokens = {longest} exceeds the {name}'s context "
                              f"(model.max_seq_len = {model.max_seq_len}); lower them")
    if r.algorithm == "grpo" and cfg.train.global_batch_size % r.group_size:
        raise ConfigError(f"train.global_batch_size = {cfg.train.global_batch_size} must be a multiple of "
                          f"rlhf.group_size = {r.group_size} (GRPO samples a group per prompt)")


def check_hybrid_engine(cfg: Config, actor: ModelConfig, world_size: int) -> None:
    """rlhf.hybrid_engine / inference_tp / gather_blocks against the actor's layout and the world: one line."""
    r = cfg.rlhf
    if r.gather_blocks < 0:
        raise ConfigError(f"rlhf.gather_blocks = {r.gather_blocks} must be >= 0 (0 = every block at once)")
    if r.inference_tp < 1:
        raise ConfigError(f"rlhf.inference_tp = {r.inference_tp} must be >= 1 (1 = a whole copy on every rank)")
    if r.inference_tp == 1:
        return
    if not r.hybrid_engine:
        raise ConfigError(f"rlhf.inference_tp = {r.inference_tp} splits the hybrid engine's copy, and "
                          "rlhf.hybrid_engine = false generates through the training layout: set inference_tp to 1")
    actor_tp = role_layout(cfg, "actor").tp
    if actor_tp > 1:
        raise ConfigError(f"rlhf.inference_tp = {r.inference_tp} re-splits a ZeRO-3 or replicated actor; this one "
                          f"trains at tp {actor_tp} (rlhf.actor_tp / parallel.tp) and generates whole: set inference_tp to 1")
    fits = valid_tp_degrees(actor, ARCHITECTURES[actor.arch].tp_shares_kv_heads)
    if world_size % r.inference_tp or r.inference_tp not in fits:
        raise ConfigError(f"rlhf.inference_tp = {r.inference_tp} must divide the {world_size} rank(s) and split "
                          f"the actor's heads and FFN; values that fit: "
                          f"{', '.join(str(t) for t in fits if world_size % t == 0)}")


def offload_frozen(r: RLHFConfig, reference: RoleModel, reward: RoleModel, copies: bool | None = None) -> None:
    """rlhf.offload_reference / offload_reward: those frozen models in host memory while idle."""
    for role, offload in ((reference, r.offload_reference), (reward, r.offload_reward)):
        if offload:
            role.offload_when_idle(copies)


def generation_for(cfg: Config, actor: RoleModel, stops: set[int]) -> Generation:
    """Step 3's sampling: through the Hybrid Engine (rlhf.hybrid_engine) or the actor's training layout."""
    r = cfg.rlhf
    sampling = Sampling(r.max_new_tokens, r.temperature, r.top_k or None, r.top_p if r.top_p < 1 else None)
    if not r.hybrid_engine:
        return TrainingLayoutGeneration(actor.model, sampling, stops, cfg.run.seed, actor.autocast)
    engine = HybridEngine(actor.runtime, actor.cfg, actor.model, r.inference_tp, r.gather_blocks)
    return HybridEngineGeneration(engine, sampling, stops, cfg.run.seed, actor.autocast)


class Step3State:
    """What a step-3 checkpoint holds: the actor (as `model` / `optim`), the critic, the EMA actor."""

    def __init__(self, engine: PPOEngine):
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        e = self.engine
        state = dict(e.actor.built.dp.state_dict())
        if e.critic is not None:
            critic = e.critic.built.dp.state_dict()
            state.update(critic=critic["model"], critic_optim=critic["optim"])
        if e.ema is not None:
            state["ema"] = e.ema.shadow  # loaded in place
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        e = self.engine
        e.actor.built.dp.load_state_dict({"model": state["model"], "optim": state["optim"]})
        if e.critic is not None:
            e.critic.built.dp.load_state_dict({"model": state["critic"], "optim": state["critic_optim"]})


def _texts(run: RLHFRun, rollout: Rollout) -> list[str]:
    """Each response as text, without the end-of-text token."""
    eos = run.tokenizer.eot_id
    return [run.tokenizer.decode([t for t in r if t != eos]) for r in rollout.responses()]


def task_score(run: RLHFRun, rows: list, rollout: Rollout) -> float | None:
    """Mean true metric of the responses (None without one); rows[b] is row b's data row."""
    if run.scorer is None:
        return None
    return sum(run.scorer(row.prompt, text) for row, text in zip(rows, _texts(run, rollout))) / len(rows)


def run_ppo(run: RLHFRun) -> dict[str, Any]:
    """Step 3 (module docstring); returns its summary (complete.json)."""
    cfg, r = run.cfg, run.cfg.rlhf
    actor_start = Start(run.actor.model, checkpoint_path(run.run_dir, "sft"), run.actor.directory)
    reward_start = trained_reward_model(run)
    configs = step3_configs(cfg, run.run_dir, actor_start.model, reward_start.model)
    step = StepRun(run, "ppo", configs["actor"])
    fresh = step.resume_from is None
    acc, world = run.acc, run.world
    actor = build_role(acc, world, configs["actor"], "actor", actor_start if fresh else None, run_dir=step.dir)
    reference = build_role(acc, world, configs["reference"], "reference", actor_start, trained=False)
    reward = build_role(acc, world, configs["reward"], "reward", reward_start, trained=False)
    critic = (build_role(acc, world, configs["critic"], "critic", reward_start if fresh else None, run_dir=step.dir)
              if "critic" in configs else None)

    data = run.phase("ppo")
    rows = [data[i] for i in range(len(data))]
    prompts = [run.encoder.prompt(row) for row in rows]
    n_eval = len(data.held_out) // world.world_size * world.world_size
    eval_rows = list(data.held_out[:n_eval]) or rows[:world.world_size]
    eval_prompts = [run.encoder.prompt(row) for row in eval_rows]
    group = r.group_size if r.algorithm == "grpo" else 1
    G = cfg.train.global_batch_size
    sampler = GlobalBatchSampler(len(prompts), G // group, cfg.run.seed)

    ptx, ptx_sampler = None, None
    if r.ptx_coef > 0:  # a language-model step on a mini-batch of step 1's data after each actor step
        sft = run.phase("sft")
        examples = [run.encoder.sft(sft[i]) for i in range(len(sft))]
        ptx_sampler = GlobalBatchSampler(len(examples), G // r.ppo_mini_batches, cfg.run.seed)

        def ptx(_step: int) -> float:
            batch = [examples[i] for i in ptx_sampler.next_batch()]
            return lm_loss_of_batch(actor, batch, run.pad_id, r.sft_mask_prompt, scale=r.ptx_coef)

    offload_frozen(r, reference, reward)
    generation = generation_for(cfg, actor, stop_tokens(run.tokenizer))
    engine = PPOEngine(actor, reference, reward, critic, r, generation, run.pad_id, ptx)

    state = step.resume(Step3State(engine), actor)
    done = 0 if state is None else state.step
    if state is not None:
        sampler.load_state_dict(state.sampler["prompts"])
        if ptx_sampler is not None:
            ptx_sampler.load_state_dict(state.sampler["ptx"])
        if critic is not None and critic.scaler is not None and state.sampler.get("critic_loss_scaler"):
            critic.scaler.load_state_dict(state.sampler["critic_loss_scaler"])
    metrics = step.metrics(done if state is not None else None)
    start = time.perf_counter()

    def positions() -> dict[str, Any]:
        out = {"prompts": sampler.state_dict()}
        if ptx_sampler is not None:
            out["ptx"] = ptx_sampler.state_dict()
        if critic is not None and critic.scaler is not None:
            out["critic_loss_scaler"] = critic.scaler.state_dict()
        return out

    def save() -> None:
        step.checkpointer.save(Step3State(engine), step.state(done, positions(), actor))

    def evaluate() -> dict[str, Any]:
        rollout = engine.rollout(eval_prompts, list(range(len(eval_prompts))), "eval")
        row = {"step": done, "eval_reward": engine.scores(rollout).mean().item(),
               "eval_task_score": task_score(run, eval_rows, rollout), "time": time.perf_counter() - start}
        metrics.log(row)
        return row

    first = evaluate() if done == 0 else {}
    saved = done if state is not None else None
    total = step.cfg.run.steps  # rlhf.ppo_steps, or run.steps when that is 0 (step3_configs)
    while done < total:
        chosen = sampler.next_batch()
        batch_rows = [rows[i] for i in chosen for _ in range(group)]  # a GRPO group: consecutive rows
        stats, exp = engine.step([prompts[i] for i in chosen for _ in range(group)],
                                 [done * G + k for k in range(G)], done)
        stats["task_score"] = task_score(run, batch_rows, exp.rollout)
        done += 1
        if done % cfg.run.log_every == 0 or done == total:
            metrics.log({"step": done, **stats, "time": time.perf_counter() - start})
        if cfg.run.eval_every and done % cfg.run.eval_every == 0 and done != total:
            evaluate()
        if cfg.checkpoint.every and done % cfg.checkpoint.every == 0:
            save()
            saved = done
    final = evaluate()
    if saved != done:
        save()
    if engine.ema is not None:
        _save_ema(run, step, engine, done)
    metrics.close()
    for role in (actor, reference, reward, critic):
        if role is not None:
            role.close()
    if world.is_main:
        plot_loss(step.dir)
        plot_panels(step.dir, "reward.png", ("reward", "kl", "task_score"))
    summary = {"step": done, "eval_reward": final["eval_reward"], "eval_task_score": final["eval_task_score"],
               "time_s": time.perf_counter() - start}
    if first:
        summary.update(first_eval_reward=first["eval_reward"], first_eval_task_score=first["eval_task_score"])
    return step.finish(summary)


def _save_ema(run: RLHFRun, step: StepRun, engine: PPOEngine, done: int) -> None:
    """The EMA actor as its own run directory (runs/<name>/ppo/ema), weights only."""
    ema_dir = RunDir(step.dir / "ema")
    if run.world.is_main:
        ema_dir.path.mkdir(parents=True, exist_ok=True)
        ema_cfg = dataclasses.replace(step.cfg, run=dataclasses.replace(step.cfg.run, out_dir=str(ema_dir.path)))
        ema_dir.config.write_text(to_toml(ema_cfg))
        run.tokenizer.save(ema_dir.tokenizer)
    barrier()
    save_weights(ema_dir.checkpoints / f"step_{done}", engine.ema.shadow, shape_config(step.cfg.model))

