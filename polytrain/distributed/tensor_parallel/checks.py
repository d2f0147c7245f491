"""Start-up checks for tensor/sequence parallelism: one line naming the key and the fix.

What the checks need to know of the architecture comes in as `SplitRules` (the start-up
layout check, polytrain/train/startup.py, reads them from the model registry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from polytrain.config import Config, ModelConfig
from polytrain.distributed.grid_shape import grid_side, grid_sizes
from polytrain.errors import ConfigError


def _one_stream(seq_len: int) -> tuple[int, ...]:
    return (seq_len,)


@dataclass(frozen=True)
class SplitRules:
    """How an architecture's layers may be split (from its registry entry)."""

    shares_kv_heads: bool = True
    """tp may exceed the KV heads, each then replicated on tp / n_kv_heads ranks."""
    grid_layers: bool = True
    """The 2d / 2.5d / 3d grid modes have layers for every role its plan uses."""
    stream_lengths: Callable[[int], tuple[int, ...]] = _one_stream
    """data.seq_len -> the token counts of the streams SP splits (T5: encoder and decoder inputs)."""


def kv_heads_split(n_kv_heads: int, tp: int, shared: bool = True) -> bool:
    """KV heads split evenly, or (`shared`) each shared by tp / n_kv_heads consecutive ranks."""
    return n_kv_heads % tp == 0 or (shared and tp % n_kv_heads == 0)


def valid_tp_degrees(m: ModelConfig, shared: bool = True) -> list[int]:
    """Every tp that splits this model's heads, KV heads (`shared`: or shares them) and FFN width."""
    return [t for t in range(1, m.n_heads + 1)
            if m.n_heads % t == 0 and m.ffn_dim % t == 0 and kv_heads_split(m.n_kv_heads, t, shared)]


def check_tensor_parallel(cfg: Config, dp: int, rules: SplitRules) -> None:
    """Fail unless parallel.tp / parallel.sp / parallel.tp_mode fit the model, the sequence, the
    ZeRO stage and (grid modes) the `dp` data-parallel ranks."""
    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        return
    if p.tp_mode != "1d":
        check_grid(cfg, dp, rules)
        return
    if p.zero in (1, 2):
        raise ConfigError(
            f"parallel.zero = {p.zero} with parallel.tp = {p.tp} is not supported yet (ZeRO-1/2 "
            f"shard replicated parameters, not tensor-parallel shards); use parallel.zero = 0 or 3")
    problems = []
    if m.n_heads % p.tp:
        problems.append(f"model.n_heads = {m.n_heads}")
    if not kv_heads_split(m.n_kv_heads, p.tp, rules.shares_kv_heads):
        problems.append(f"model.n_kv_heads = {m.n_kv_heads} (tp must divide it" + (
            " or be a multiple of it)" if rules.shares_kv_heads else
            f": {m.arch} packs each KV head with its query heads, which then cannot be split)"))
    if m.ffn_dim % p.tp:
        problems.append(f"model.ffn_dim = {m.ffn_dim}")
    if problems:
        valid = ", ".join(map(str, valid_tp_degrees(m, rules.shares_kv_heads)))
        raise ConfigError(f"parallel.tp = {p.tp} does not split {' and '.join(problems)}; "
                          f"tp values that fit this model: {valid}")
    if p.sp:
        _check_stream_lengths(cfg, rules.stream_lengths)


def grid_splits(m: ModelConfig, mode: str, q: int) -> dict[str, tuple[int, int]]:
    """Model field -> (value, what must divide it) for a grid of side q.

    2D/2.5D split heads, KV heads, FFN width and vocabulary q ways (a weight block is
    (out/q, in/q)); 3D splits heads and KV heads q ways but every weight's output
    features q^2 ways (out by j, then by i).
    """
    out = q * q if mode == "3d" else q
    kv_dim = m.n_kv_heads * (m.dim // m.n_heads)
    return {"model.n_heads": (m.n_heads, q), "model.n_kv_heads": (m.n_kv_heads, q),
            "model.dim": (m.dim, out), "model.n_kv_heads x head_dim": (kv_dim, out),
            "model.ffn_dim": (m.ffn_dim, out), "model.vocab_size": (m.vocab_size, out)}


def check_grid(cfg: Config, dp: int, rules: SplitRules) -> None:
    """Fail unless parallel.tp is a grid of parallel.tp_mode that fits the model, batch and layout."""
    p, m, mode = cfg.parallel, cfg.model, cfg.parallel.tp_mode
    if not rules.grid_layers:
        # The grid layers implement the roles a Llama plan uses; the other architectures'
        # extra roles (biases, position tables, packed wqkv, cross-attention) are 1d only.
        raise ConfigError(f"parallel.tp_mode = '{mode}' has layers for model.arch = 'llama' only; "
                          f"model.arch = '{m.arch}' runs with parallel.tp_mode = '1d'")
    depth = p.tp_depth if mode == "2.5d" else 1
    shape = {"2d": "q x q", "2.5d": f"q x q x tp_depth ({depth})", "3d": "q x q x q"}[mode]
    q = grid_side(mode, p.tp, depth)
    if q is None:
        sizes = [s for s in grid_sizes(mode, depth, 4 * p.tp) if s > 1]
        near = [s for s in sizes if s < p.tp][-1:] + [s for s in sizes if s > p.tp][:1]
        raise ConfigError(f"parallel.tp = {p.tp} is not a {shape} grid (tp_mode '{mode}'); nearest valid "
                          f"{mode} sizes: {', '.join(map(str, near))}")
    fixes = {"parallel.sp": (p.sp, "false: the grid already splits every activation"),
             "parallel.pp": (p.pp != 1, "1: pipeline stages are not composed with grid modes yet"),
             "parallel.zero": (p.zero != 0, "0: ZeRO does not shard grid blocks yet"),
             "model.tie_embeddings": (m.tie_embeddings, "false: the embedding and head blocks differ"),
             "parallel.dp": (dp != 1 and mode != "2d",
                             "1 (or tp_mode '2d'): torch's FSDP2 composes with at most two tp mesh axes")}
    for key, (wrong, fix) in fixes.items():
        if wrong:
            raise ConfigError(f"{key} with parallel.tp_mode = '{mode}' must be {fix}")
    problems = [f"{key} = {value}" for key, (value, by) in grid_splits(m, mode, q).items() if value % by]
    if problems:
        fits = [size for size in grid_sizes(mode, depth, 4096) if size > 1 and not any(
            value % by for value, by in grid_splits(m, mode, grid_side(mode, size, depth)).values())]
        raise ConfigError(f"tp_mode '{mode}' at parallel.tp = {p.tp} (q = {q}) does not split "
                          f"{' and '.join(problems)}; tp values of {mode} that fit this model: "
                          f"{', '.join(map(str, fits)) or 'none'}")
    parts = q * q if mode == "3d" else q * depth
    batch = cfg.train.micro_batch_size
    if batch % parts:
        raise ConfigError(f"tp_mode '{mode}' at tp = {p.tp} gives each rank 1/{parts} of the micro-batch's "
                          f"sequences; train.micro_batch_size = {batch} is not a multiple of {parts}; "
                          f"use {(batch // parts + 1) * parts}")


def _check_stream_lengths(cfg: Config, stream_lengths: Callable[[int], tuple[int, ...]]) -> None:
    """SP splits every token stream (T5: the encoder's and the decoder's) into tp equal parts."""
    tp, seq = cfg.parallel.tp, cfg.data.seq_len
    lengths = stream_lengths(seq)
    if not any(n % tp for n in lengths):
        return
    if len(lengths) == 1:
        raise ConfigError(
            f"parallel.sp splits each sequence into parallel.tp = {tp} equal parts, but "
            f"data.seq_len = {seq} is not a multiple of {tp}; use data.seq_len = "
            f"{seq // tp * tp or tp} or {(seq // tp + 1) * tp}, or parallel.sp = false")
    fits = [n for n in range(max(seq - 8 * tp, 2), seq + 8 * tp + 1)
            if not any(length % tp for length in stream_lengths(n))]
    hint = f"use data.seq_len = {min(fits, key=lambda n: abs(n - seq))}" if fits else "set parallel.sp = false"
    enc, dec = lengths
    raise ConfigError(
        f"parallel.sp splits the encoder's {enc} and the decoder's {dec} input tokens (from "
        f"data.seq_len = {seq}) into parallel.tp = {tp} equal parts; {hint}, or parallel.sp = false")
