"""`polytrain plan`'s output: a table of the best layouts that fit, why, and the command to run one."""

from __future__ import annotations

import json

from polytrain.config import Config
from polytrain.plan.devices import GiB, Cluster
from polytrain.plan.planner import Estimate


def _gb(value: float) -> str:
    return f"{value / GiB:.1f} GB"


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 1e-3 else f"{value * 1e3:.3g} ms"


def _tokens(value: float) -> str:
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.1f}k" if value >= 1e3 else f"{value:.0f}"


def _largest(parts: dict[str, float], n: int, unit) -> str:
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{name} {unit(value)}" for name, value in top)


def why(best: Estimate, cluster: Cluster, others: list[Estimate]) -> list[str]:
    """Reasons this layout is proposed: its headroom and costs, and what the alternatives lose."""
    limit = cluster.device.memory_bytes
    t = best.time
    lines = [f"fits: {_gb(best.memory.total)} of {_gb(limit)} at its peak ({best.memory.phase}); "
             f"largest parts {_largest(best.memory.parts, 3, _gb)}",
             f"step {_seconds(t.total)}: {_largest(t.parts, 4, _seconds)}"]
    plain = [e for e in others if e.layout.tp == 1 and e.layout.pp == 1 and e.layout.cp == 1]
    if best.layout.tp * best.layout.pp * best.layout.cp > 1 and plain:
        alt = min(plain, key=lambda e: (not e.fits, e.time.total if e.fits else e.memory.total))
        if alt.fits:
            lines.append(f"pure data parallelism ({alt.layout.describe()}) fits too but takes "
                         f"{_seconds(alt.time.total)} a step")
        else:
            lines.append(f"pure data parallelism does not fit: at best {_gb(alt.memory.total)} "
                         f"({_largest(alt.memory.parts, 2, _gb)})")
    return lines


def format_table(cfg: Config, cluster: Cluster, estimates: list[Estimate], top: int, shape_params: int,
                 config_path: str | None = None) -> str:
    """The human report: what was planned, the top layouts, why the first, and its command line."""
    m, t, d = cfg.model, cfg.train, cluster.device
    fitting = [e for e in estimates if e.fits]
    header = [
        f"model {m.arch} {m.size}: {shape_params / 1e9:.2f}B parameters | global batch {t.global_batch_size} x "
        f"{cfg.data.seq_len} tokens | {t.precision} | {t.optimizer}",
        f"cluster: {cluster.devices} x {d.name} ({_gb(d.memory_bytes)}), {cluster.nodes} node(s) of "
        f"{cluster.per_node}; links {d.intra_node_bw / 1e9:.0f} GB/s in a node, {d.inter_node_bw / 1e9:.0f} "
        f"GB/s between nodes",
        f"{len(estimates)} layouts start-up accepts; {len(fitting)} fit",
    ]
    if not fitting:
        closest = estimates[:max(1, top)]
        lines = header + ["nothing fits. Closest:"] + [
            f"  {e.layout.describe()}: {_gb(e.memory.total)} ({_largest(e.memory.parts, 3, _gb)})" for e in closest]
        lines.append("more devices, a larger --device-memory, recomputation, offload or a smaller micro-batch "
                     "would help; or a smaller global batch or sequence")
        return "\n".join(lines)
    shown = fitting[:top] if top else fitting
    width = max(len(e.layout.describe()) for e in shown)
    rows = [f"  {'#':>2}  {'layout':<{width}}  {'memory/rank':>11}  {'step':>9}  {'tokens/s':>9}  {'MFU':>5}"]
    for i, e in enumerate(shown, 1):
        rows.append(f"  {i:>2}  {e.layout.describe():<{width}}  {_gb(e.memory.total):>11}  "
                    f"{_seconds(e.time.total):>9}  {_tokens(e.tokens_per_s):>9}  {e.mfu:>5.0%}")
    best = fitting[0]
    reasons = why(best, cluster, estimates)
    command = f"polytrain train{f' --config {config_path}' if config_path else ''} {best.layout.command()}"
    return "\n".join(header + [""] + rows + ["", f"best: {best.layout.describe()}"] +
                     [f"  {line}" for line in reasons] + [f"  run: {command}"])


def format_json(estimates: list[Estimate], top: int) -> str:
    """The `--json` list: best first, each layout's config keys, memory_gb per rank and step_time_s."""
    fitting = [e for e in estimates if e.fits] or estimates
    shown = fitting[:top] if top else fitting
    return json.dumps([e.as_json() for e in shown], indent=1)
