"""Start-up checks for tensor/sequence parallelism: one line naming the key and the fix."""

from __future__ import annotations

from polytrain.config import Config, ConfigError, ModelConfig
from polytrain.models import ARCHITECTURES


def kv_heads_split(n_kv_heads: int, tp: int, shared: bool = True) -> bool:
    """KV heads split evenly, or (`shared`) each shared by tp / n_kv_heads consecutive ranks."""
    return n_kv_heads % tp == 0 or (shared and tp % n_kv_heads == 0)


def valid_tp_degrees(m: ModelConfig) -> list[int]:
    """Every tp that splits this model's heads, KV heads and FFN width."""
    shared = ARCHITECTURES[m.arch].tp_shares_kv_heads
    return [t for t in range(1, m.n_heads + 1)
            if m.n_heads % t == 0 and m.ffn_dim % t == 0 and kv_heads_split(m.n_kv_heads, t, shared)]


def check_tensor_parallel(cfg: Config) -> None:
    """Fail unless parallel.tp / parallel.sp fit the model, the sequence and the ZeRO stage."""
    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        return
    if p.zero in (1, 2):
        raise ConfigError(
            f"parallel.zero = {p.zero} with parallel.tp = {p.tp} is not supported yet (ZeRO-1/2 "
            f"shard replicated parameters, not tensor-parallel shards); use parallel.zero = 0 or 3")
    arch = ARCHITECTURES[m.arch]
    problems = []
    if m.n_heads % p.tp:
        problems.append(f"model.n_heads = {m.n_heads}")
    if not kv_heads_split(m.n_kv_heads, p.tp, arch.tp_shares_kv_heads):
        problems.append(f"model.n_kv_heads = {m.n_kv_heads} (tp must divide it" + (
            " or be a multiple of it)" if arch.tp_shares_kv_heads else
            f": {m.arch} packs each KV head with its query heads, which then cannot be split)"))
    if m.ffn_dim % p.tp:
        problems.append(f"model.ffn_dim = {m.ffn_dim}")
    if problems:
        valid = ", ".join(map(str, valid_tp_degrees(m)))
        raise ConfigError(f"parallel.tp = {p.tp} does not split {' and '.join(problems)}; "
                          f"tp values that fit this model: {valid}")
    seq = cfg.data.seq_len
    if p.sp and arch.kind == "encoder-decoder":
        _check_span_lengths(cfg)
    elif p.sp and seq % p.tp:
        raise ConfigError(
            f"parallel.sp splits each sequence into parallel.tp = {p.tp} equal parts, but "
            f"data.seq_len = {seq} is not a multiple of {p.tp}; use data.seq_len = "
            f"{seq // p.tp * p.tp or p.tp} or {(seq // p.tp + 1) * p.tp}, or parallel.sp = false")


def _span_lengths(cfg: Config, seq_len: int) -> tuple[int, int]:
    """(encoder, decoder) input lengths of T5's span corruption of `seq_len`-token windows."""
    from polytrain.data.objectives import span_counts

    noise, spans = span_counts(seq_len, cfg.data.mask_fraction, cfg.data.mean_span_length)
    return seq_len - noise + spans, noise + spans + 1


def _check_span_lengths(cfg: Config) -> None:
    """SP splits both of an encoder-decoder's streams: each input length must be a multiple of tp."""
    tp, seq = cfg.parallel.tp, cfg.data.seq_len
    enc, dec = _span_lengths(cfg, seq)
    if enc % tp or dec % tp:
        fits = [n for n in range(max(seq - 8 * tp, 2), seq + 8 * tp + 1) if not any(
            length % tp for length in _span_lengths(cfg, n))]
        hint = f"use data.seq_len = {min(fits, key=lambda n: abs(n - seq))}" if fits else "set parallel.sp = false"
        raise ConfigError(
            f"parallel.sp splits the encoder's {enc} and the decoder's {dec} input tokens (span corruption "
            f"of data.seq_len = {seq}) into parallel.tp = {tp} equal parts; {hint}, or parallel.sp = false")
