"""The loop steps 1 and 2 share: one model, a global batch of rows per optimizer step, evaluations, checkpoints.

    summary = supervised_loop(step_run, role, n_rows, train_batch, evaluate)

Step k trains on rows [k G, (k + 1) G) of a seeded permutation of the step's rows
(`GlobalBatchSampler` over the whole batch; each model takes its data-parallel slice), so
the rows of a step do not depend on the layout and a resume continues at the next row.
`train_batch(rows)` runs forward and backward on this rank's share and returns the batch's
metrics (all ranks agree on them); `evaluate()` returns the held-out metrics, logged at
step 0, every run.eval_every steps and at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from polytrain.data import GlobalBatchSampler
from polytrain.rlhf.roles import RoleModel
from polytrain.rlhf.stepdir import StepRun


def supervised_loop(step: StepRun, role: RoleModel, n_rows: int,
                    train_batch: Callable[[list[int]], dict[str, float]],
                    evaluate: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """Train `role` for step.cfg.run.steps optimizer steps (module docstring); returns the final metrics."""
    cfg = step.cfg
    sampler = GlobalBatchSampler(n_rows, cfg.train.global_batch_size, cfg.run.seed)
    state = step.resume(role.built.dp, role)
    done = 0 if state is None else state.step
    if state is not None:
        sampler.load_state_dict(state.sampler)
    metrics = step.metrics(done if state is not None else None)
    start = time.perf_counter()

    def log_eval() -> dict[str, float]:
        row = evaluate()
        metrics.log({"step": done, **row, "time": time.perf_counter() - start})
        return row

    if done == 0:
        log_eval()
    saved = done if state is not None else None
    last: dict[str, Any] = {}
    while done < cfg.run.steps:
        role.model.train()
        last = train_batch(sampler.next_batch())
        last.update(role.step(done))
        done += 1
        if done % cfg.run.log_every == 0 or done == cfg.run.steps:
            metrics.log({"step": done, **last, "time": time.perf_counter() - start})
        if cfg.run.eval_every and done % cfg.run.eval_every == 0 and done != cfg.run.steps:
            log_eval()
        if cfg.checkpoint.every and done % cfg.checkpoint.every == 0:
            step.checkpointer.save(role.built.dp, step.state(done, sampler.state_dict(), role))
            saved = done
    final = log_eval()
    if saved != done:
        step.checkpointer.save(role.built.dp, step.state(done, sampler.state_dict(), role))
    metrics.close()
    role.close()
    return {"step": done, **{k: v for k, v in last.items() if k in ("loss", "accuracy")}, **final,
            "time_s": time.perf_counter() - start}
