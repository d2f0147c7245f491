"""Step 3 at other layouts reproduces the single process's step: the same samples, losses and updated weights.

One PPO step (rollout, the four models' no-grad pass, one actor and one critic step) on
one process, sampling through the training layout, is the reference. Two ranks then run
the same step at several layouts, in one launch:
  - dp 2: the actor, the critic and the reference sharded by ZeRO-3 (the critic by ZeRO-2),
    the reward model replicated; every rank generates its own half of the samples;
  - tp 2 with sequence parallelism: the actor, the critic and the reward model split over
    both ranks (the value heads replicated, their values gathered along the sequence), the
    reference replicated at dp 2: models of different data-parallel degrees in one step;
  - dp 2 ZeRO-3 again, sampling through the Hybrid Engine (rlhf.hybrid_engine) with the
    reference and reward model offloaded while idle: the same as the reference;
  - dp 2 ZeRO-3 with LoRA adapters (non-zero B) through the training layout, and through
    the engine (adapters fused, one block gathered at a time, re-split to inference tp 2):
    the engine reproduces the run without it;
  - dp 2 ZeRO-3 with rlhf.ppo_epochs 2 and rlhf.ppo_mini_batches 2 (four clipped updates on
    one rollout) against the single process with the same keys.
Sampling is at rlhf.temperature 0.7, and the single process's step shows the log-probabilities
scored at it: before the first update the policy ratio is exactly 1.
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
        "--rlhf.max_prompt_len", "8", "--rlhf.max_new_tokens", "6", "--rlhf.temperature", "0.7", "--run.seed", "5"]
ZERO3 = ["--rlhf.actor_zero", "3", "--rlhf.reference_zero", "3", "--rlhf.critic_zero", "2", "--rlhf.reward_zero", "0"]
OFF, ON = ["--rlhf.hybrid_engine", "false"], ["--rlhf.hybrid_engine", "true"]
LORA = ["--lora.rank", "4", "--lora.alpha", "8"]
EPOCHS = ["--rlhf.ppo_epochs", "2", "--rlhf.ppo_mini_batches", "2"]
LAYOUTS = {
    "dp2_zero3": ZERO3 + OFF,
    "tp2_sp": ["--parallel.sp", "true", "--rlhf.actor_tp", "2", "--rlhf.reward_tp", "2", "--rlhf.reference_tp", "1",
               *OFF],
    "dp2_zero3_engine": ZERO3 + ON + ["--rlhf.offload_reference", "true", "--rlhf.offload_reward", "true"],
    "dp2_zero3_lora": ZERO3 + LORA + OFF,
    "dp2_zero3_lora_engine": ZERO3 + LORA + ON + ["--rlhf.gather_blocks", "1", "--rlhf.inference_tp", "2"],
    "dp2_zero3_epochs": ZERO3 + OFF + EPOCHS,
}
SAME_AS_ONE_PROCESS = ("dp2_zero3", "tp2_sp", "dp2_zero3_engine")
STATS = ("reward", "kl", "entropy", "policy_loss", "clip_frac", "value_loss", "grad_norm", "critic_grad_norm")
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12], [13, 14], [15, 16, 17], [18], [19, 20]]


def _full(model: torch.nn.Module) -> dict:
    """Whole parameters as numpy arrays (pickled by value: the ranks' processes end before the test reads them)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().numpy().copy()
            for n, p in model.named_parameters()}


def _local_bytes(model: torch.nn.Module) -> int:
    """Bytes this rank's parameters hold in their storages (0 when parked)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes() for p in model.parameters())


@torch.no_grad()
def _set_adapters(model: torch.nn.Module) -> None:
    """B of every adapter from (name)-seeded noise, so fusing them matters; the same at every layout."""
    import zlib

    from torch.distributed.tensor import distribute_tensor

    for name, param in model.named_parameters():
        if name.endswith(".lora_b"):
            full = 0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param = param.to_local()
            param.copy_(full)


def _ppo_step(rank: int, world_size: int, layouts: list[list[str]]) -> list[dict]:
    from polytrain.backend import get_accelerator
    from polytrain.config import load_config
    from polytrain.distributed.world import init_world
    from polytrain.rlhf.ppo import generation_for, offload_frozen, step3_configs
    from polytrain.rlhf.ppo_engine import PPOEngine
    from polytrain.rlhf.roles import build_role
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
        if cfg.lora.rank:
            _set_adapters(roles["actor"].model)
        before = _full(roles["actor"].model)
        offload_frozen(cfg.rlhf, roles["reference"], roles["reward"], copies=True)  # bytes moved, on a CPU too
        generation = generation_for(cfg, roles["actor"], set(range(8)))
        engine = PPOEngine(roles["actor"], roles["reference"], roles["reward"], roles["critic"], cfg.rlhf,
                           generation, pad_id=0)
        stats, exp = engine.step(PROMPTS, list(range(8)), 0)
        if world.world_size == 1:  # the sampled tokens' log-probabilities at the sampling temperature, by hand
            ids = exp.rollout.ids
            with torch.no_grad():  # the frozen reference holds the actor's starting weights
                logits = roles["reference"].model(ids[:, :-1]).double() / cfg.rlhf.temperature
            rescored = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            with torch.no_grad():  # the trained actor's log-probabilities of the same tokens
                after = roles["actor"].logprobs(ids, cfg.rlhf.temperature)
        out.append({"dims": dims, "stats": stats, "responses": exp.rollout.responses(),
                    "advantages": exp.advantages.cpu().numpy(), "mask": exp.mask.cpu().numpy(), "before": before,
                    "old_logprobs": exp.old_logprobs.cpu().numpy(),
                    "rescored": rescored.cpu().numpy() if world.world_size == 1 else None,
                    "after": after.cpu().numpy() if world.world_size == 1 else None,
                    "actor": _full(roles["actor"].model), "critic": _full(roles["critic"].model),
                    "generation": type(generation).__name__,
                    "offload_moves": {n: r.idle.moves for n, r in roles.items() if r.idle is not None},
                    "parked_bytes": {n: _local_bytes(r.model) for n, r in roles.items() if r.idle is not None}})
        for role in roles.values():
            role.close()
    return out


@pytest.fixture(scope="module")
def results():
    one_process = dict(zip(("plain", "epochs"), _ppo_step(0, 1, [OFF, OFF + EPOCHS])))
    ranks = run_ranks(2, _ppo_step, list(LAYOUTS.values()))
    return one_process, dict(zip(LAYOUTS, ranks[0])), dict(zip(LAYOUTS, ranks[1]))


def _assert_same_step(got: dict, want: dict) -> None:
    """The same samples, advantages, stats and updated actor and critic (float tolerance)."""
    assert got["responses"] == want["responses"]  # the same tokens sampled
    torch.testing.assert_close(torch.from_numpy(got["advantages"]), torch.from_numpy(want["advantages"]),
                               rtol=1e-4, atol=1e-5)
    for key in STATS:
        assert got["stats"][key] == pytest.approx(want["stats"][key], rel=1e-4, abs=1e-6), key
    for model in ("actor", "critic"):
        for n, value in want[model].items():
            torch.testing.assert_close(torch.from_numpy(got[model][n]), torch.from_numpy(value), rtol=1e-4,
                                       atol=1e-5, msg=f"{model} {n}")


def _moved(run: dict) -> float:
    return max(abs(run["actor"][n] - run["before"][n]).max() for n in run["actor"])


@pytest.mark.parametrize("name", SAME_AS_ONE_PROCESS)
def test_ppo_step_matches_one_process(results, name):
    one_process, rank0, rank1 = results
    reference, got = one_process["plain"], rank0[name]
    zero3 = {"actor": (2, 1, 3, False), "reference": (2, 1, 3, False), "reward": (2, 1, 0, False),
             "critic": (2, 1, 2, False)}
    want_dims = {  # (dp, tp, zero, sp) of each model
        "dp2_zero3": zero3, "dp2_zero3_engine": zero3,
        "tp2_sp": {"actor": (1, 2, 0, True), "reference": (2, 1, 0, False), "reward": (1, 2, 0, True),
                   "critic": (1, 2, 0, True)}}
    assert got["dims"] == want_dims[name]
    assert reference["generation"] == "TrainingLayoutGeneration"
    assert got["responses"] == rank1[name]["responses"]
    assert any(len(r) < 6 for r in reference["responses"]) and any(len(r) == 6 for r in reference["responses"])
    assert _moved(reference) > 1e-3  # the step changed the actor, so equal weights mean equal updates
    _assert_same_step(got, reference)


def test_the_hybrid_engine_reproduces_the_training_layout_run(results):
    """Engine on = engine off (ZeRO-3 against the one process above, and here with LoRA fused at
    inference tp 2); the offloaded frozen models went to host memory and came back around their passes."""
    _, rank0, rank1 = results
    assert rank0["dp2_zero3_engine"]["generation"] == rank0["dp2_zero3_lora_engine"]["generation"] == \
        "HybridEngineGeneration"
    assert rank0["dp2_zero3_lora"]["generation"] == "TrainingLayoutGeneration"
    for ranks in (rank0, rank1):
        _assert_same_step(ranks["dp2_zero3_lora_engine"], ranks["dp2_zero3_lora"])
        # parked at build (their storages freed: the ZeRO-3 reference's shards too), then after each pass
        assert ranks["dp2_zero3_engine"]["offload_moves"] == {"reference": 2, "reward": 2}
        assert ranks["dp2_zero3_engine"]["parked_bytes"] == {"reference": 0, "reward": 0}
        assert ranks["dp2_zero3"]["offload_moves"] == {}
    assert _moved(rank0["dp2_zero3_lora"]) > 1e-3  # the adapters trained
    assert rank0["dp2_zero3_lora"]["responses"] != rank0["dp2_zero3"]["responses"]  # and changed the samples
    for key in ("time_generate", "time_experience", "time_train", "gen_tokens_per_s", "peak_gb_generate",
                "peak_gb_experience", "peak_gb_train"):
        assert rank0["dp2_zero3_engine"]["stats"][key] > 0, key


def test_one_pass_of_one_mini_batch_is_exactly_on_policy_at_the_sampling_temperature(results):
    """rlhf.temperature 0.7: the old log-probabilities are log softmax(logits / 0.7) of the sampled tokens, and
    the actor's new ones and the reference's are scored the same way, so before any update the policy ratio is
    exactly 1 (surrogate -mean(A), nothing clipped) and the KL to the reference, the actor's twin, is 0."""
    reference = results[0]["plain"]
    stats, mask, adv = reference["stats"], reference["mask"], reference["advantages"]
    torch.testing.assert_close(torch.from_numpy(reference["old_logprobs"][mask]).double(),
                               torch.from_numpy(reference["rescored"][mask]), rtol=1e-5, atol=1e-5)
    assert stats["clip_frac"] == 0 and stats["kl"] == 0
    assert stats["policy_loss"] == pytest.approx(-(adv * mask).sum() / mask.sum(), rel=1e-5, abs=1e-7)


def test_epochs_of_mini_batches_engage_the_clip_and_match_one_process_at_dp2_zero3(results):
    """rlhf.ppo_epochs 2 x rlhf.ppo_mini_batches 2: four actor and critic steps on one rollout, each rank on
    its half of each mini-batch; the ratio leaves 1 after the first, and the run equals the one process's."""
    one_process, rank0, rank1 = results
    want = one_process["epochs"]
    assert want["responses"] == one_process["plain"]["responses"]  # the same rollout, more updates on it
    assert want["stats"]["clip_frac"] > 0
    for ranks in (rank0, rank1):
        _assert_same_step(ranks["dp2_zero3_epochs"], want)
    assert _moved(want) > 2 * _moved(one_process["plain"])
    # The updates raise the surrogate on the rollout: log pi moves along the advantages, further with four.
    gains = {name: ((run["after"] - run["old_logprobs"]) * run["advantages"])[run["mask"]].sum()
             for name, run in one_process.items()}
    assert 0 < gains["plain"] < gains["epochs"]
