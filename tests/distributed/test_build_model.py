"""Two models with different layouts built in one process on the same world, both trained.

What RLHF needs (an actor, a critic, a reference and a reward model in one job): the builder
makes a model for any runtime, and `runtime.with_dims(...)` gives a second layout over the same
processes. On 2 ranks a ZeRO-3 model (sharded over dp 2) and a replicated one of another shape
take 4 steps, interleaved, on the same batches as one process; each follows its own
single-process loss curve, and the sharded one really holds half of each block's weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.multirank import run_ranks

STEPS, BATCH, SEQ = 4, 4, 16


def _configs():
    from polytrain.config import load_config

    common = ["--model.dim", "32", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", "64",
              "--model.vocab_size", "128", "--data.seq_len", str(SEQ), "--train.micro_batch_size", "2",
              "--train.global_batch_size", str(BATCH), "--train.lr", "1e-2", "--train.warmup_steps", "0",
              "--run.seed", "3"]
    sharded = load_config(None, common + ["--model.n_layers", "2", "--parallel.zero", "3"])
    replicated = load_config(None, common + ["--model.n_layers", "3", "--parallel.zero", "0",
                                             "--model.tie_embeddings", "true"])
    return sharded, replicated


def _train_both(rank: int, world_size: int) -> dict[str, list[float]]:
    from polytrain.distributed.world import mean_over_world
    from polytrain.optim.schedule import set_lr
    from polytrain.train.build import build_model
    from polytrain.train.startup import plan_layout, start

    cfg_a, cfg_b = _configs()
    runtime_a, layout_a = start(cfg_a)
    runtime_b = runtime_a.with_dims(plan_layout(cfg_b, runtime_a.world.world_size).dims)
    models = {"sharded": (build_model(runtime_a, cfg_a, layout_a.pipeline), cfg_a, runtime_a),
              "replicated": (build_model(runtime_b, cfg_b), cfg_b, runtime_b)}
    optimizers = {name: built.dp.build_optimizer(built.model, cfg.train) for name, (built, cfg, _) in models.items()}
    # One global batch, seen every step: the models memorise it, so the losses must fall.
    tokens = torch.randint(0, 128, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(11))
    losses: dict[str, list[float]] = {name: [] for name in models}
    for step in range(STEPS):
        for name, (built, cfg, runtime) in models.items():
            share = tokens[runtime.dp_rank::runtime.dp_size]  # this rank's rows of it
            built.dp.before_micro_batch(built.model, last=True)
            loss = built.loss(built.model, [share[:, :-1]], share[:, 1:])
            loss.backward()
            built.dp.clip_grad_norm_(1.0)
            set_lr(optimizers[name], step, cfg)
            built.dp.step()
            built.dp.zero_grad()
            losses[name].append(mean_over_world(loss.detach()).item())
    block = models["sharded"][0].model.layers["0"].attention.wq.weight
    losses["sharded_rows"] = [float(block.to_local().shape[0]) if world_size > 1 else float(block.shape[0])]
    return losses


@pytest.mark.slow
def test_two_layouts_in_one_process_each_follow_their_single_process_run():
    one = run_ranks(1, _train_both)[0]
    two = run_ranks(2, _train_both)
    for name in ("sharded", "replicated"):
        assert two[0][name] == pytest.approx(one[name], rel=1e-5), name
        assert one[name][-1] < one[name][0]  # both actually trained
    assert two[0]["sharded_rows"] == [one["sharded_rows"][0] / 2]  # ZeRO-3 holds half of each weight
