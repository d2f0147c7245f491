"""`polytrain plan` for Llama-2 7B and 70B on 8 and 64 H100-80GB, next to Megatron's and DeepSpeed's estimators.

    python benchmarks/plan_vs_estimators.py          # seconds; needs deepspeed (pip install -e .[compat])

For each model and cluster (sequence 4096, global batch 1024 sequences, bf16, AdamW):

- polytrain's best layout and, for the same model and cluster, two reference layouts
  written the way each peer would run them: ZeRO-3 over every device (DeepSpeed's way)
  and tp 8 with sequence parallelism and selective recomputation, pipelines as needed
  (Megatron's way); polytrain's per-rank estimate of each (polytrain.plan.evaluate);
- DeepSpeed 0.19's own estimators, called here: model states per GPU for ZeRO-2
  (`estimate_zero2_model_states_mem_needs`) and ZeRO-3
  (`estimate_zero3_model_states_mem_needs`), without offload, at the layout's
  data-parallel size; they count no activations;
- Megatron-LM's `report_theoretical_memory` formulas (megatron/training/
  theoretical_memory_usage.py; megatron-core does not ship that module, so
  `megatron_estimate` recomputes them from its documented terms): weights and optimizer
  of the most loaded shard (18 bytes a parameter, or 6 + 12/dp with the distributed
  optimizer) and Korthikanti et al.'s activations for sequence parallelism with selective
  recomputation, sbh(18 + 4 ffn/h) per layer on the first pipeline stage.

docs/PLANNING.md explains the differences.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
GB = 2**30
COMMON = ["--data.seq_len", "4096", "--train.global_batch_size", "1024", "--train.precision", "bf16"]
MODELS = {"Llama-2 7B": ["--model.size", "7b"], "Llama-2 70B": ["--config", "configs/llama2_70b.toml"]}
CLUSTERS = [(8, 1), (64, 8)]


def megatron_estimate(m, tp: int, pp: int, dp: int, mbs: int, seq: int, micro_batches: int,
                      distributed_optimizer: bool) -> tuple[float, float]:
    """(weights + optimizer, activations) bytes on Megatron's most loaded rank (SP + selective recompute)."""
    hd = m.dim // m.n_heads
    q = hd * m.n_heads
    layers = 2 * m.n_layers * m.dim * m.dim * (
        (1 + m.n_kv_heads / m.n_heads) * q / m.dim + m.ffn_dim / m.dim * 1.5 + 2 / m.dim + 1 / (m.n_layers * m.dim))
    embedding = m.dim * m.vocab_size
    shard = (layers / pp + embedding) / tp
    if pp == 1:
        shard += embedding / tp  # untied output layer on the same stage
    per_param = 6 + 12 / dp if distributed_optimizer else 18
    states = shard * per_param
    sbh = seq * mbs * m.dim
    act = sbh * (18 + 4 * m.ffn_dim / m.dim) * m.n_layers
    act += 8 * seq * mbs * pp + sbh * pp  # embedding input and dropout, pp micro-batches in flight
    if pp > 1:
        act *= min(1, micro_batches / pp)
    else:
        act += sbh * 4 * (1 + m.vocab_size / m.dim)  # output layer input and the loss
    return states, act / tp


def deepspeed_estimates(psi: int, largest: int, dp: int, per_node: int) -> tuple[float, float]:
    """(ZeRO-2, ZeRO-3) model-state bytes per GPU, DeepSpeed's own functions, no offload."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    nodes = max(1, dp // per_node)
    gpus = dp // nodes
    _, zero2 = estimate_zero2_model_states_mem_needs(psi, gpus, nodes, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(psi, largest, gpus, nodes, cpu_offload=False,
                                                        cpu_offload_params=False)
    return zero2, zero3


def _states(est) -> float:
    """Model states at the optimizer step: weights, masters, optimizer state and gradients."""
    p = est.memory.phases["optimizer step"]
    return sum(p.get(k, 0.0) for k in ("weights", "weights (shards)", "master weights", "optimizer state",
                                       "gradients"))


def _megatron_pp(m, devices: int, dp_of) -> int:
    """Pipeline stages a Megatron user would pick with tp 8: the fewest its own formula fits in 80 GB."""
    for pp in (1, 2, 4, 8, 16):
        if devices % (8 * pp):
            break
        dp = dp_of(pp)
        states, act = megatron_estimate(m, 8, pp, dp, 1, 4096, 1024 // dp, distributed_optimizer=True)
        if states + act < 79.2 * GB:
            return pp
    return max(1, min(8, devices // 8))


def main() -> None:
    import torch

    from polytrain.config import load_config
    from polytrain.plan import Cluster, Layout, device_spec, evaluate, model_shape, plan

    print(f"{datetime.date.today()}, torch {torch.__version__}; estimates only (no GPU ran). Sequence 4096, "
          f"global batch 1024 sequences, bf16 autocast, AdamW; H100 SXM 80GB (79.2 GB usable), 8 per node. "
          f"GB = 2^30 bytes.")
    for name, model_args in MODELS.items():
        cfg = load_config(*_split(model_args + COMMON))
        shape = model_shape(cfg)
        m = cfg.model
        largest = max(u.total for u in shape.units.values())
        for devices, nodes in CLUSTERS:
            cluster = Cluster(device_spec("H100"), devices, nodes)
            estimates = plan(cfg, cluster)
            best = estimates[0]
            pp = _megatron_pp(m, devices, lambda pp: devices // (8 * pp))
            dp = devices // (8 * pp)
            rows = [("polytrain plan's first" + ("" if best.fits else " (nothing fits: the closest)"), best),
                    ("DeepSpeed's way: ZeRO-3 over all, recompute full", evaluate(cfg, shape, Layout(
                        world=devices, dp=devices, zero=3, micro_batch_size=1, accum=1024 // devices,
                        activation_checkpoint="full"), cluster)),
                    # ZeRO-3 where dp > 1: polytrain's nearest to Megatron's distributed optimizer
                    # (ZeRO-1/2 do not compose with tp yet).
                    (f"Megatron's way: tp 8 sp, pp {pp}, selective", evaluate(cfg, shape, Layout(
                        world=devices, dp=dp, zero=3 if dp > 1 else 0, tp=8, sp=True, pp=pp, micro_batch_size=1,
                        accum=1024 // dp, activation_checkpoint="selective"), cluster))]
            print(f"\n{name} ({shape.num_params / 1e9:.2f}B parameters) on {devices} H100 ({nodes} node(s)): "
                  f"{sum(e.fits for e in estimates)} of {len(estimates)} layouts fit\n")
            print("| layout | polytrain GB/rank | of it: states / activations+loss / other | fits | step s | "
                  "Megatron formula GB (states + activations) | DeepSpeed states GB ZeRO-2 / ZeRO-3 |")
            print("| --- | ---: | --- | --- | ---: | --- | --- |")
            for label, est in rows:
                lay, parts = est.layout, est.memory.parts
                acts = parts.get("activations", 0.0) + parts.get("loss", 0.0)
                states = sum(parts.get(k, 0.0) for k in ("weights", "weights (shards)", "master weights",
                                                         "optimizer state", "gradients"))
                other = est.memory.total - acts - states
                if lay.tp > 1 and lay.sp:  # the case Megatron's report covers (SP + selective)
                    ms, ma = megatron_estimate(m, lay.tp, lay.pp, lay.dp, 1, 4096, lay.accum, True)
                    mega = f"{(ms + ma) / GB:.1f} ({ms / GB:.1f} + {ma / GB:.1f})"
                else:
                    mega = "- (covers SP + selective only)"
                z2, z3 = deepspeed_estimates(int(shape.num_params / (lay.tp * lay.pp)), largest // lay.tp, lay.dp, 8)
                print(f"| {label}: {lay.describe()} | {est.memory_gb:.1f} | {states / GB:.1f} / {acts / GB:.1f} / "
                      f"{other / GB:.1f} | {'yes' if est.fits else 'no'} | {est.time.total:.1f} | {mega} | "
                      f"{z2 / GB:.1f} / {z3 / GB:.1f} |")
    print("\nCommand: python benchmarks/plan_vs_estimators.py")


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    if "--config" in args:
        i = args.index("--config")
        return args[i + 1], args[:i] + args[i + 2:]
    return None, args


if __name__ == "__main__":
    main()
