"""Start-up checks of context parallelism: one line each, naming the key and the nearest valid values.

    ring, ulysses = cp_degrees(cp, mode, cp_ulysses)
    check_context_parallel(cp, mode, cp_ulysses, seq_len, n_heads, n_kv_heads, tp)

What users hit in other frameworks (DeepSpeed #5177, EasyContext #47, verl #1226): a sequence
that does not split into the zigzag chunks, heads that do not split over the Ulysses degree,
a hybrid split that does not divide the cp degree. Each is caught here, before any rank starts.
"""

from __future__ import annotations

import math

from polytrain.config import Config
from polytrain.distributed.context_parallel.layout import Layout
from polytrain.errors import ConfigError

MODES = ("ulysses", "ring", "hybrid")


def cp_degrees(cp: int, mode: str, cp_ulysses: int) -> tuple[int, int]:
    """(ring, ulysses) degrees for parallel.cp, parallel.cp_mode and parallel.cp_ulysses."""
    if cp < 1:
        raise ConfigError(f"parallel.cp = {cp} must be at least 1")
    if mode not in MODES:
        raise ConfigError(f"parallel.cp_mode = {mode!r} is not one of {', '.join(MODES)}")
    if mode == "ulysses":
        return 1, cp
    if mode == "ring":
        return cp, 1
    if cp_ulysses < 1 or cp % cp_ulysses:
        raise ConfigError(f"parallel.cp_ulysses = {cp_ulysses} must divide parallel.cp = {cp} "
                          f"(hybrid runs Ulysses inside groups of cp_ulysses ranks, a ring across them); "
                          f"choose one of {', '.join(map(str, _divisors(cp)))}")
    return cp // cp_ulysses, cp_ulysses


def check_context_parallel(cp: int, mode: str, cp_ulysses: int, seq_len: int, n_heads: int,
                           n_kv_heads: int, tp: int = 1, sp: bool = False) -> None:
    """ConfigError unless the sequence and the heads (per tensor-parallel rank) fit the cp degrees;
    with sequence parallelism (sp) each cp rank's tokens must also split over tp."""
    ring, ulysses = cp_degrees(cp, mode, cp_ulysses)
    if mode != "hybrid" and cp_ulysses != 1:
        raise ConfigError(f"parallel.cp_ulysses = {cp_ulysses} only applies with parallel.cp_mode = 'hybrid'; "
                          f"remove it or set cp_mode = 'hybrid'")
    if cp == 1:
        return
    _check_sequence(seq_len, ring, ulysses, mode)
    if sp and seq_len % (cp * tp):
        raise ConfigError(f"data.seq_len = {seq_len} is not a multiple of parallel.cp x parallel.tp = {cp} x {tp} "
                          f"(sequence parallelism splits each cp rank's tokens over tp); "
                          f"use {_nearest(seq_len, math.lcm(Layout(0, ring, ulysses).divisor, cp * tp))}")
    if ulysses > 1:
        _check_heads(n_heads, n_kv_heads, tp, ulysses, mode)


def check_cp_config(cfg: Config, kind: str) -> None:
    """The whole config against context parallelism and packed documents; `kind`: the architecture's
    ("decoder", "encoder", "encoder-decoder")."""
    p, m, d = cfg.parallel, cfg.model, cfg.data
    if p.cp > 1 or d.packed_documents:
        what = "parallel.cp > 1" if p.cp > 1 else "data.packed_documents = true"
        if kind != "decoder":
            raise ConfigError(f"{what} runs decoders (causal LM); model.arch = '{m.arch}' is an {kind} model")
    if d.packed_documents and p.pp > 1:
        raise ConfigError("data.packed_documents = true with parallel.pp > 1: the pipeline's stages get no "
                          "document ids; set parallel.pp = 1 (use parallel.cp / parallel.tp)")
    if p.cp == 1:
        check_context_parallel(1, p.cp_mode, p.cp_ulysses, d.seq_len, m.n_heads, m.n_kv_heads)
        return
    if p.tp_mode != "1d":
        raise ConfigError(f"parallel.cp > 1 with parallel.tp_mode = '{p.tp_mode}': the grid modes split the "
                          f"sequence themselves; use tp_mode = '1d'")
    if m.dropout > 0:
        raise ConfigError(f"model.dropout = {m.dropout} with parallel.cp > 1: context-parallel attention has "
                          f"no attention dropout; set model.dropout = 0")
    original = m.rope_original_max_len or m.max_seq_len
    if m.rope_scaling == "dynamic" and d.seq_len > original:
        raise ConfigError(f"model.rope_scaling = 'dynamic' beyond model.rope_original_max_len = {original} with "
                          f"parallel.cp > 1: each rank would pick its own RoPE base; use 'linear' or 'llama3'")
    check_context_parallel(p.cp, p.cp_mode, p.cp_ulysses, d.seq_len, m.n_heads, m.n_kv_heads, p.tp, p.sp)


def _check_sequence(seq_len: int, ring: int, ulysses: int, mode: str) -> None:
    step = Layout(0, ring, ulysses).divisor
    if seq_len % step == 0:
        return
    why = {"ulysses": f"parallel.cp = {ulysses} (Ulysses splits the sequence evenly)",
           "ring": f"2 x parallel.cp = {step} (ring attention's zigzag chunks)",
           "hybrid": f"{step} (2 x {ring} zigzag chunks over the ring, each ring rank's split over "
                     f"cp_ulysses = {ulysses})"}[mode]
    raise ConfigError(f"data.seq_len = {seq_len} is not a multiple of {why}; "
                      f"use {_nearest(seq_len, step)}")


def _check_heads(n_heads: int, n_kv_heads: int, tp: int, ulysses: int, mode: str) -> None:
    key = "parallel.cp" if mode == "ulysses" else "parallel.cp_ulysses"
    heads = n_heads // tp  # query heads on one tensor-parallel rank
    where = f" per tensor-parallel rank (model.n_heads / parallel.tp = {n_heads} / {tp})" if tp > 1 else ""
    if heads % ulysses:
        valid = [d for d in _divisors(heads) if d > 1]
        raise ConfigError(f"{key} = {ulysses} must divide the {heads} attention heads{where}; "
                          f"choose one of {', '.join(map(str, valid)) or '1 (no Ulysses)'}"
                          + ("" if mode == "ulysses" else " or parallel.cp_mode = 'ring'"))
    kv = max(n_kv_heads // tp, 1)  # tensor parallelism replicates KV heads it cannot split
    if kv % ulysses and ulysses % kv:
        raise ConfigError(f"{key} = {ulysses} and the {kv} key/value heads{where}: one must divide the "
                          f"other (Ulysses splits the KV heads, or repeats each on ulysses / n_kv_heads "
                          f"ranks); choose one of {', '.join(map(str, _kv_fits(heads, kv)))}")


def _kv_fits(heads: int, kv: int) -> list[int]:
    return [d for d in _divisors(heads) if d > 1 and (kv % d == 0 or d % kv == 0)]


def _nearest(value: int, step: int) -> str:
    below, above = value // step * step, (value // step + 1) * step
    return f"{below} or {above}" if below > 0 else str(above)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
