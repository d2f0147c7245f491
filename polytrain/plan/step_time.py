"""Time of one optimizer step for a layout: compute over the device's peak, communication over the links.

    compute      the model's training FLOPs per token x the global batch's tokens, split over
                 all ranks, at peak x efficiency (lower for thin matmuls: few tokens per
                 micro-batch, a narrow tp shard; a CPU's ranks share its cores); the slowest
                 pipeline stage (the last one also runs the head) sets the pace; full
                 recomputation adds the blocks' forward again, selective the attention core's
    bubble       1F1B / GPipe (pp - 1) / m of the compute, interleaved (pp - 1) / (m v),
                 ZB-V a third of 1F1B's (m = micro-batches per step and rank)
    tp           Korthikanti et al. per micro-batch: 2 f b BTD (4L + 2) for the blocks'
                 all-reduces (or sequence parallelism's all-gather + reduce-scatter, the same
                 bytes) plus the vocabulary-parallel loss's 2 f 4 x 3BT, f = (tp - 1) / tp
                 (benchmarks/tp_comm.py checks these against the bytes really sent)
    dp / ZeRO    2 f' 4P per step for replicas and ZeRO-1 (f' = (N - 1) / N); ZeRO-2 reduce-
                 scatters every micro-batch (f' 4P each) and all-gathers once; ZeRO-3
                 gathers twice and reduce-scatters once per micro-batch (3 f' 4P each;
                 benchmarks/zero_memory_comm.py checks the 2 and 3); where the backend
                 reduce-scatters by all-reduce (gloo) that part counts twice. Overlapped with
                 backward up to the device's `overlap` share of it
    pp           each rank sends its activations forward and their gradients back: 2 x 4BTD
                 per micro-batch
    cp           ring: K and V go round the ring in forward, K, V, dK, dV in backward:
                 3 (cp - 1) x 2 B(T/cp) Hkv hd b per block; Ulysses: four all-to-alls each way,
                 (cp - 1)/cp of q, k, v and the output per block, twice
    optimizer    Adam reads and writes ~28 bytes a parameter at the device's memory bandwidth;
                 offloaded, the host steps it and the gradients and weights cross PCIe

Each collective runs at the bandwidth of the link its group spans: ranks are ordered tp
(innermost), cp, dp, pp, so a group stays inside a node while its span fits there.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.config import Config
from polytrain.plan.devices import Cluster
from polytrain.plan.layouts import Layout
from polytrain.plan.memory import FP32, compute_bytes, pipeline_plan, rank_units
from polytrain.plan.shapes import ModelShape, tp_split

ADAM_BYTES_PER_PARAM = 28  # read w, g, m, v; write w, m, v (fp32)


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds of one step, by part; `total` is their sum (communication parts already net of overlap)."""

    parts: dict[str, float]
    comm_bytes: dict[str, float]
    """Bytes one rank sends per step, by kind."""

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def estimate_step_time(cfg: Config, shape: ModelShape, layout: Layout, cluster: Cluster) -> TimeEstimate:
    """The step time of `layout` (see the module docstring)."""
    m, t = cfg.model, cfg.train
    device = cluster.device
    seq = cfg.data.seq_len
    rows_per_matmul = layout.micro_batch_size * seq / layout.cp
    rate = device.flops(t.precision) * cluster.rank_share() * matmul_efficiency(
        device, rows_per_matmul, m.ffn_dim / layout.tp)
    tokens_step = t.global_batch_size * seq
    head_flops = 6 * m.vocab_size * m.dim
    block_flops = shape.flops_per_token - head_flops
    # The slowest pipeline stage: its share of the blocks, and the head on the last one.
    plan = pipeline_plan(cfg, shape, layout)
    if plan is None:
        stage_flops = shape.flops_per_token
    else:
        most = max(sum(u.startswith("layers.") for u in rank_units(cfg, shape, plan, r)) for r in range(layout.pp))
        stage_flops = block_flops * most / m.n_layers + head_flops
    rows = tokens_step / (layout.dp * layout.cp)  # tokens one pipeline's ranks process per step
    model_parallel = layout.tp  # tp ranks share each matmul
    compute = rows * stage_flops / (model_parallel * rate)
    recompute = 0.0
    if layout.activation_checkpoint == "full":
        recompute = compute * (block_flops / stage_flops) / 3  # one more forward of the blocks
    elif layout.activation_checkpoint == "selective":
        attention_forward = 4 * m.n_layers * m.n_heads * shape.head_dim * seq / layout.pp
        recompute = rows * attention_forward / (model_parallel * rate)
    parts = {"compute": compute, "recompute": recompute, "pipeline bubble": (compute + recompute) * _bubble(layout)}

    comm = _comm_bytes(cfg, shape, layout, cluster)
    spans = {"tp": layout.tp, "cp": layout.tp * layout.cp, "pp": layout.world,
             "dp": layout.tp * layout.cp * layout.dp}
    seconds = {kind: sent / cluster.group_bandwidth(spans[kind]) for kind, sent in comm.items()}
    backward = 2 / 3 * (compute + recompute)
    hidden = device_overlap(cluster) * backward
    parts["tp comm"] = seconds.get("tp", 0.0)
    parts["pp comm"] = seconds.get("pp", 0.0)
    parts["cp comm"] = max(0.0, seconds.get("cp", 0.0) - hidden)
    parts["dp comm (exposed)"] = max(0.0, seconds.get("dp", 0.0) - hidden)
    parts["optimizer"] = _optimizer_seconds(cfg, shape, layout, cluster)
    return TimeEstimate({k: v for k, v in parts.items() if v}, comm)


def matmul_efficiency(device, rows: float, width: float) -> float:
    """Share of peak a block's matmuls reach: the device's efficiency, less for thin matmuls (few
    tokens per micro-batch, or a feed-forward split thin by tp): each dimension x costs x / (x + knee)."""
    knee = device.gemm_knee
    return device.efficiency * rows / (rows + knee) * width / (width + knee)


def device_overlap(cluster: Cluster) -> float:
    """Share of backward that data-parallel communication can hide behind: most on accelerators
    (own copy engines), little on a CPU, whose cores also run the collectives."""
    return 0.3 if cluster.device.cores_per_node else 0.9


def _bubble(layout: Layout) -> float:
    """Idle share of a pipeline rank's step (see the module docstring)."""
    if layout.pp == 1:
        return 0.0
    m, pp = layout.accum, layout.pp
    if layout.pp_schedule == "interleaved":
        return (pp - 1) / (m * layout.pp_virtual_stages)
    if layout.pp_schedule == "zero_bubble":
        return (pp - 1) / (3 * m)
    return (pp - 1) / m


def _comm_bytes(cfg: Config, shape: ModelShape, layout: Layout, cluster: Cluster) -> dict[str, float]:
    """Bytes one rank sends per step, by the axis it talks over."""
    m, t = cfg.model, cfg.train
    cb = compute_bytes(t.precision)
    tokens = layout.micro_batch_size * cfg.data.seq_len / layout.cp  # per micro-batch and rank
    micro = layout.accum
    layers = m.n_layers / layout.pp
    out: dict[str, float] = {}
    if layout.tp > 1:
        f = (layout.tp - 1) / layout.tp
        # Sequence parallelism gathers the fp32 norm outputs; the reductions move matmul outputs.
        b = (cb + FP32) / 2 if layout.sp else cb
        blocks = 2 * f * b * tokens * m.dim * (4 * layers + 2)
        loss = 2 * f * FP32 * 3 * tokens  # max, sum of exponentials, target logit (last stage)
        out["tp"] = micro * (blocks + loss)
    if layout.cp > 1:
        c = layout.cp
        kv_width = m.n_kv_heads * shape.head_dim
        if layout.cp_mode == "ring":
            per_block = 3 * (c - 1) * 2 * tokens * kv_width * cb / layout.tp
        else:
            width = (2 * m.n_heads * shape.head_dim + 2 * kv_width) / layout.tp
            per_block = 2 * (c - 1) / c * tokens * width * cb
        out["cp"] = micro * layers * per_block
    if layout.pp > 1:
        hidden = tokens * m.dim * FP32 / (layout.tp if layout.sp else 1)
        out["pp"] = micro * 2 * hidden
    n = layout.dp
    if n > 1:
        params = sum(shape.unit_params_per_rank(u, layout.tp, layout.tp_mode, layout.tp_depth)
                     for u in shape.units) / layout.pp
        f = (n - 1) / n
        scatter = 2 if cluster.device.cores_per_node else 1  # gloo: reduce-scatter done as all-reduce
        whole = FP32 * params
        if layout.zero in (0, 1):
            out["dp"] = 2 * f * whole
        elif layout.zero == 2:
            out["dp"] = micro * scatter * f * whole + f * whole
        else:
            rounds = 1 if layout.pp > 1 else micro  # pipeline stages stay gathered through the step
            out["dp"] = rounds * (2 + scatter) * f * whole
    return out


def _optimizer_seconds(cfg: Config, shape: ModelShape, layout: Layout, cluster: Cluster) -> float:
    """The optimizer step: memory-bound on the device, or on the host with offload."""
    device = cluster.device
    split = tp_split(layout.tp, layout.tp_mode, layout.tp_depth)
    params = shape.num_params / (split * layout.pp)
    if layout.zero in (1, 2, 3):
        params /= layout.dp
    if layout.offload != "none":
        ranks_per_node = cluster.per_node
        host = params * ranks_per_node / device.host_adam_params_per_s
        link = 2 * FP32 * params / device.host_link_bw if device.host_link_bw else 0.0
        return host + link
    return ADAM_BYTES_PER_PARAM * params / device.memory_bw
