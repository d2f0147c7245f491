"""Autoregressive sampling with a KV cache.

Prompts of different lengths run as one left-padded batch: row b gets
`pad[b] = longest - len(prompt_b)` padding slots in front. The KVCache carries
`pad`, from which the model derives per-row RoPE positions (slot - pad) and a
mask that hides padding slots, so each row computes what its prompt alone
would. After one prefill pass over the padded prompts, each step feeds one
token per row.

The model is only called as `model(tokens, cache=..., start_pos=...)` and read
for `model.cfg` and its parameters' device, so an FSDP-wrapped model works too.
Encoder-decoders (T5) use `generate_seq2seq`: the prompt is encoded once and the
decoder runs from a start token with the same sampling loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn

from polytrain.backend import host_attention, host_matmul
from polytrain.inference.continuous import generate_static
from polytrain.inference.threaded_matmul import threaded_linears
from polytrain.models.common.attention import Attention
from polytrain.models.common.kv_cache import KVCache


def generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             stop_tokens: set[int] | None = None,
             generator: torch.Generator | None = None,
             row_generators: list[torch.Generator] | None = None,
             all_done: Callable[[bool], bool] | None = None,
             static_cache: bool = False, batch_size: int | None = None,
             compile: bool = False, threaded_matmul: bool = True) -> list[list[int]]:
    """Continue each prompt by up to `max_new_tokens` tokens; returns only the new tokens.

    temperature 0 picks the most likely token (greedy); otherwise logits are divided
    by temperature, filtered by top_k and/or top_p (nucleus), and sampled with
    `generator`, or row b with `row_generators[b]` (its tokens then do not depend on
    the other rows of the batch). A row ends after it emits a token in `stop_tokens`
    (that token is included); generation ends when every row has ended or after
    max_new_tokens. `all_done(local)` lets ranks that generate through one sharded
    model agree on when to stop (every rank must run the same forwards).

    static_cache: decode over a fixed-shape cache, at most `batch_size` prompts at once
    (default all), a finished row taking the next prompt (continuous batching);
    `compile` compiles the decoding step (implies static_cache). Greedy tokens are the
    same either way; sampled ones come from the same distributions in another order.

    threaded_matmul: decoding's few-row products with host-resident Linear weights go through
    polytrain's host kernel (1-16 rows, 1-48 in bf16 where it runs on AMX: each weight read once
    for all rows; sums rounded in another order than F.linear's, so a greedy token can change only
    where two logits tie within fp32 rounding) or, where the kernel cannot be built, one fp32 row
    is split over torch's threads where that measured faster (bitwise F.linear's products); a bf16
    prefill on a CPU that emulates bf16 GEMMs streams through the kernel or runs fp32 GEMMs;
    threaded_matmul.py.
    With it, a host model's decoding attention runs on the host attention kernel
    (backend/host_attention.py: each cache row read once for all query heads of its group).
    False: F.linear and SDPA throughout.
    """
    _check_arguments(prompts, max_new_tokens, temperature, top_k, top_p)
    if row_generators is not None and len(row_generators) != len(prompts):
        raise ValueError(f"{len(row_generators)} row_generators for {len(prompts)} prompts")
    static = static_cache or compile or batch_size is not None
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size = {batch_size} must be >= 1")
    if static and (row_generators is not None or all_done is not None):
        raise ValueError("row_generators and all_done need the padded batch (static_cache, batch_size "
                         "and compile off): a refilled row changes prompts mid-run")
    longest = max(len(p) for p in prompts)
    max_seq_len = model.cfg.max_seq_len
    if longest + max_new_tokens > max_seq_len:
        raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens = {max_new_tokens} "
                         f"exceeds the model's max_seq_len = {max_seq_len}; shorten the prompt "
                         "or ask for fewer tokens")
    if max_new_tokens == 0:
        return [[] for _ in prompts]

    if static:
        rows = min(batch_size or len(prompts), len(prompts))
        with _inference(model, rows, threaded_matmul):
            return generate_static(model, prompts, max_new_tokens,
                                   lambda logits: sample(logits, temperature, top_k, top_p, generator),
                                   stop_tokens or set(), batch_size, compile)

    device = next(model.parameters()).device
    batch = len(prompts)
    pads = [longest - len(p) for p in prompts]
    # (B, L) left-padded with token 0; the cache's mask keeps padding out of attention.
    tokens = torch.tensor([[0] * n + p for n, p in zip(pads, prompts)], device=device)
    pad = torch.tensor(pads, device=device) if any(pads) else None  # (B,)
    cache = KVCache(batch, longest + max_new_tokens, pad=pad)

    def step(next_tok: torch.Tensor, i: int) -> torch.Tensor:
        return model(next_tok[:, None], cache=cache, start_pos=longest + i)[:, -1]

    with _inference(model, batch, threaded_matmul):
        first = model(tokens, cache=cache, start_pos=0, logits_at=-1)[:, 0]  # (B, vocab)
        return _sample_loop(first, step, max_new_tokens, temperature, top_k, top_p, stop_tokens,
                            generator, row_generators, all_done)


def generate_seq2seq(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, *,
                     temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                     stop_tokens: set[int] | None = None, generator: torch.Generator | None = None,
                     start_token: int = 0, threaded_matmul: bool = True) -> list[list[int]]:
    """Encoder-decoder (T5) generation: each prompt is encoded once, the decoder writes up to
    `max_new_tokens` tokens after `start_token`; sampling and stopping as `generate`.

    Prompts of different lengths are right-padded and masked out of every attention
    over the encoder's output. The model provides encode(tokens, attention_mask) and
    decode(tokens, memory, attention_mask, cache=, start_pos=).
    """
    _check_arguments(prompts, max_new_tokens, temperature, top_k, top_p)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    tokens = torch.tensor([p + [0] * (longest - len(p)) for p in prompts], device=device)  # (B, S)
    mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in prompts], device=device)
    cache = KVCache(len(prompts), max_new_tokens)

    with _inference(model, len(prompts), threaded_matmul):
        memory = model.encode(tokens, mask)  # (B, S, dim)

        def step(next_tok: torch.Tensor, i: int) -> torch.Tensor:
            return model.decode(next_tok[:, None], memory, mask, cache=cache, start_pos=i + 1)[:, -1]

        start = torch.full((len(prompts),), start_token, device=device)
        first = model.decode(start[:, None], memory, mask, cache=cache, start_pos=0)[:, -1]  # (B, vocab)
        return _sample_loop(first, step, max_new_tokens, temperature, top_k, top_p, stop_tokens, generator)


@contextlib.contextmanager
def _inference(model: nn.Module, rows: int, threaded_matmul: bool):
    """eval mode and no autograd, decoding's `rows`-row products threaded where measured faster;
    the model's mode and layers restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), threaded_linears(model, rows, threaded_matmul), _decode_kernel(model, threaded_matmul):
            yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _decode_kernel(model: nn.Module, enabled: bool):
    """Each attention layer's decoding attention through the host kernel while inside
    (backend.host_attention), for a model held on the host where the kernel builds."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    host = all(p.device.type == "cpu" for p in model.parameters())
    if not (enabled and layers and host and host_matmul.available()):
        yield
        return
    for layer in layers:
        layer.decode_kernel = host_attention.decode_attention
    try:
        yield
    finally:
        for layer in layers:
            del layer.decode_kernel


def _sample_loop(first: torch.Tensor, step, max_new_tokens: int, temperature: float, top_k: int | None,
                 top_p: float | None, stop_tokens: set[int] | None, generator: torch.Generator | None,
                 row_generators: list[torch.Generator] | None = None,
                 all_done: Callable[[bool], bool] | None = None) -> list[list[int]]:
    """Sample a token per row from `first` (B, vocab), then from step(tokens (B,), i) for i = 0, 1, ...
    until every row has emitted a stop token or max_new_tokens are out; rows cut after their stop."""
    stops = torch.tensor(sorted(stop_tokens or ()), dtype=torch.long, device=first.device)
    logits, new = first, []
    done = torch.zeros(first.shape[0], dtype=torch.bool, device=first.device)
    for i in range(max_new_tokens):
        if row_generators is None:
            next_tok = sample(logits, temperature, top_k, top_p, generator)  # (B,)
        else:  # each row from its own stream: (1, vocab) at a time
            next_tok = torch.cat([sample(logits[b:b + 1], temperature, top_k, top_p, g)
                                  for b, g in enumerate(row_generators)])
        new.append(next_tok)
        done |= torch.isin(next_tok, stops)
        if i == max_new_tokens - 1:
            break
        finished = bool(done.all())
        if finished if all_done is None else all_done(finished):
            break
        logits = step(next_tok, i)
    return [until_stop(row, stop_tokens or set()) for row in torch.stack(new, 1).tolist()]


def sample(logits: torch.Tensor, temperature: float, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of logits (B, vocab) -> (B,); temperature 0 = argmax."""
    logits = logits.float()
    if temperature == 0:
        return argmax_rows(logits)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the
        # mass; the most likely token always stays.
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if generator is not None:  # sample where the generator lives; results then match across devices
        return torch.multinomial(probs.to(generator.device), 1, generator=generator)[:, 0].to(logits.device)
    return torch.multinomial(probs, 1)[:, 0]


ARGMAX_CHUNK = 128


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> (B,) the index of each row's maximum, the first of equal ones, as argmax.

    torch's CPU argmax compares one element at a time (180 us for (8, 32000) fp32, ~0.7% of a
    compiled batch-8 llama 125m decoding step), its amax is vectorised: so the maximum of each chunk of
    ARGMAX_CHUNK elements first, then argmax over the chunk maxima and inside the first chunk
    holding the row's maximum (57 us). A NaN, a maximum to amax and argmax alike, wins as in argmax.
    """
    B, V = logits.shape
    # Below 16K elements the chunks' ~35 us of calls cost more than they save (one Xeon: argmax
    # 14 us against 35 at (1, 8192), level at (8, 2048), 45 against 37 at (1, 32000)).
    if B * V < 16 * 1024:
        return logits.argmax(-1)
    whole = V - V % ARGMAX_CHUNK
    maxima = logits[:, :whole].view(B, -1, ARGMAX_CHUNK).amax(-1)  # (B, V // CHUNK)
    if whole < V:
        maxima = torch.cat([maxima, logits[:, whole:].amax(-1, keepdim=True)], 1)
    chunk = maxima.argmax(-1, keepdim=True)  # (B, 1)
    # the chunk's indices, the last chunk's clamped to V - 1: repeats after the real last element
    index = (chunk * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK, device=logits.device)).clamp_(max=V - 1)
    return index.gather(1, logits.gather(1, index).argmax(-1, keepdim=True))[:, 0]


def until_stop(row: list[int], stop_tokens: set[int]) -> list[int]:
    """The row up to and including its first stop token."""
    for i, tok in enumerate(row):
        if tok in stop_tokens:
            return row[:i + 1]
    return row


def _check_arguments(prompts: list[list[int]], max_new_tokens: int, temperature: float,
                     top_k: int | None, top_p: float | None) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt needs a token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens = {max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature = {temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k = {top_k} must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p} must be in (0, 1]")
