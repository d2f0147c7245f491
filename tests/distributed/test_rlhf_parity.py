"""Step 3 at other layouts reproduces the single process's step: the same samples, losses and updated weights.

One PPO step (rollout, the four models' no-grad pass, one actor and one critic step) on
one process is the reference. Two ranks then run the same step twice, in one launch:
  - dp 2: the actor, the critic and the reference sharded by ZeRO-3 (the critic by ZeRO-2),
    the reward model replicated; every rank generates its own half of the samples;
  - tp 2 with sequence parallelism: the actor, the critic and the reward model split over
    both ranks (the value heads replicated, their values gathered along the sequence), the
    reference replicated at dp 2: models of different data-parallel degrees in one step.
Each sample draws from its own seeded generator, so every layout samples the same tokens;
SGD keeps the update linear in the gradient, so weights agree to float tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.multirank import run_ranks

BASE = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_dim", "64", "--model.vocab_size", "48", "--model.max_seq_len", "32", "--data.seq_len", "32",
        "--train.global_batch_size", "8", "--train.micro_batch_size", "2", "--train.optimizer", "sgd",
        "--train.lr", "0.5", "--train.warmup_steps", "1", "--train.momentum", "0",
        "--rlhf.max_prompt_len", "8", "--rlhf.max_new_tokens", "6", "--run.seed", "5"]
LAYOUTS = {
    "dp2_zero3": ["--rlhf.actor_zero", "3", "--rlhf.reference_zero", "3", "--rlhf.critic_zero", "2",
                  "--rlhf.reward_zero", "0"],
    "tp2_sp": ["--parallel.sp", "true", "--rlhf.actor_tp", "2", "--rlhf.reward_tp", "2", "--rlhf.reference_tp", "1"],
}
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12], [13, 14], [15, 16, 17], [18], [19, 20]]


def _full(model: torch.nn.Module) -> dict:
    """Whole parameters as numpy arrays (pickled by value: the ranks' processes end before the test reads them)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().numpy().copy()
            for n, p in model.named_parameters()}


def _ppo_step(rank: int, world_size: int, layouts: list[list[str]]) -> list[dict]:
    from polytrain.backend import get_accelerator
    from polytrain.config import load_config
    from polytrain.distributed.world import init_world
    from polytrain.rlhf.ppo import step3_configs
    from polytrain.rlhf.ppo_engine import PPOEngine
    from polytrain.rlhf.roles import build_role
    from polytrain.rlhf.rollout import Sampling, TrainingLayoutGeneration
    from polytrain.rlhf.sources import planned_models

    acc = get_accelerator()
    world = init_world(acc)
    out = []
    for extra in layouts:
        cfg = load_config(None, BASE + extra)
        actor_model, reward_model = planned_models(cfg)
        configs = step3_configs(cfg, cfg.run_dir, actor_model, reward_model)
        roles = {name: build_role(acc, world, c, name, trained=name in ("actor", "critic"))
                 for name, c in configs.items()}
        dims = {name: (r.runtime.dims.dp, r.runtime.dims.tp, r.runtime.dims.zero, r.runtime.dims.sp)
                for name, r in roles.items()}
        before = _full(roles["actor"].model)
        generation = TrainingLayoutGeneration(roles["actor"].model, Sampling(6), set(range(8)), cfg.run.seed)
        engine = PPOEngine(roles["actor"], roles["reference"], roles["reward"], roles["critic"], cfg.rlhf,
                           generation, pad_id=0)
        stats, exp = engine.step(PROMPTS, list(range(8)), 0)
        out.append({"dims": dims, "stats": stats, "responses": exp.rollout.responses(),
                    "advantages": exp.advantages.cpu().numpy(), "before": before,
                    "actor": _full(roles["actor"].model), "critic": _full(roles["critic"].model)})
        for role in roles.values():
            role.close()
    return out


@pytest.fixture(scope="module")
def results():
    reference = _ppo_step(0, 1, [[]])[0]
    ranks = run_ranks(2, _ppo_step, list(LAYOUTS.values()))
    return reference, dict(zip(LAYOUTS, ranks[0])), dict(zip(LAYOUTS, ranks[1]))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ppo_step_matches_one_process(results, name):
    reference, rank0, rank1 = results
    got = rank0[name]
    want_dims = {  # (dp, tp, zero, sp) of each model
        "dp2_zero3": {"actor": (2, 1, 3, False), "reference": (2, 1, 3, False), "reward": (2, 1, 0, False),
                      "critic": (2, 1, 2, False)},
        "tp2_sp": {"actor": (1, 2, 0, True), "reference": (2, 1, 0, False), "reward": (1, 2, 0, True),
                   "critic": (1, 2, 0, True)}}
    assert got["dims"] == want_dims[name]
    assert got["responses"] == rank1[name]["responses"] == reference["responses"]  # the same tokens sampled
    assert any(len(r) < 6 for r in reference["responses"]) and any(len(r) == 6 for r in reference["responses"])
    torch.testing.assert_close(torch.from_numpy(got["advantages"]), torch.from_numpy(reference["advantages"]),
                               rtol=1e-4, atol=1e-5)
    for key in ("reward", "kl", "entropy", "policy_loss", "clip_frac", "value_loss", "grad_norm", "critic_grad_norm"):
        assert got["stats"][key] == pytest.approx(reference["stats"][key], rel=1e-4, abs=1e-6), key
    moved = max(abs(reference["actor"][n] - reference["before"][n]).max() for n in reference["actor"])
    assert moved > 1e-3  # the step changed the actor, so equal weights mean equal updates
    for model in ("actor", "critic"):
        for n, want in reference[model].items():
            torch.testing.assert_close(torch.from_numpy(got[model][n]), torch.from_numpy(want), rtol=1e-4, atol=1e-5,
                                       msg=f"{model} {n}")
