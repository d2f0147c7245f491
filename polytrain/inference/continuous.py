"""Decoding with a static KV cache: one compiled step, rows refilled as they finish.

`generate(..., static_cache=True)` (or `batch_size=` / `compile=`) runs here. Up to
`batch_size` prompts decode at once, each in its own row of a `StaticKVCache`; a row that
emits a stop token or reaches max_new_tokens takes the next waiting prompt (continuous
batching), so a long batch of prompts never waits for its slowest row and the batch stays
full. Every decoding step has the same shapes, one token per row over the whole cache
with a mask, so `compile=True` compiles it once (`torch.compile` of the whole forward,
the sampling outside). The prompts admitted together (all rows at the start, the rows
freed by one step later) are prefilled in one forward per prompt length, each into its own
rows from slot 0, so a row computes what its prompt alone would, as the padded batches of
`generate` do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from polytrain.models.common.kv_cache import StaticKVCache

BACKEND = "inductor"
"""torch.compile backend of the decoding step; tests may set "aot_eager" (the graph, no code generation)."""


def decode_step(model: nn.Module, cache: StaticKVCache, compile_: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """tokens (B,), one per row -> logits (B, vocab) of each row's next token; advances the cache."""
    def step(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, None], cache=cache, start_pos=0)[:, -1]  # (B, vocab)
        cache.advance()
        return logits

    if not compile_:
        return step
    # Inductor checks the shape and strides of each input and operator output again inside the
    # graph (size_asserts): some 230 Python calls a step, 5% of a batch-8 llama 125m step on a
    # CPU, over inputs Dynamo's guards have checked and outputs the operators' fake kernels fix.
    compiled = torch.compile(step, backend=BACKEND, options={"size_asserts": False} if BACKEND == "inductor" else None)
    # A sharded model (FSDP, tp) may swap its parameters' layouts around forwards: all guards, every step.
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    warm = False

    def guarded_once(tokens: torch.Tensor) -> torch.Tensor:
        nonlocal warm
        if not warm or sharded:  # all guards: pick (or compile) the graph of this model, cache and batch
            warm = True
            return compiled(tokens)
        # Every later step of this call has the first one's model, cache, shapes and dtypes, so
        # only the guards that tell this graph from other calls' run: evaluating all of them
        # (each parameter's and cache tensor's) took ~0.7 ms of a ~17 ms bf16 batch-1 llama 125m
        # step on a CPU.
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return compiled(tokens)

    return guarded_once


def generate_static(model: nn.Module, prompts: list[list[int]], max_new_tokens: int,
                    sample_rows: Callable[[torch.Tensor], torch.Tensor], stop_tokens: set[int],
                    batch_size: int | None = None, compile_: bool = False) -> list[list[int]]:
    """New tokens of each prompt (stop token included), decoding `batch_size` rows at a time.

    `sample_rows` maps logits (R, vocab) to tokens (R,). Call under no_grad, in eval mode.
    """
    device = next(model.parameters()).device
    rows = min(batch_size or len(prompts), len(prompts))
    cache = StaticKVCache(rows, max(map(len, prompts)) + max_new_tokens, device)
    step = decode_step(model, cache, compile_)
    waiting = deque(range(len(prompts)))
    owner: list[int | None] = [None] * rows  # the prompt each row decodes
    new: list[list[int]] = [[] for _ in prompts]
    tokens = torch.zeros(rows, dtype=torch.long, device=device)  # (B,) each row's latest token

    def admit(free: list[int]) -> list[int]:
        """Prefill the next waiting prompts into the rows `free`, those of one length together,
        and sample each one's first token; returns the rows that took a prompt."""
        taken = free[:len(waiting)]
        by_length: dict[int, list[int]] = {}
        for r in taken:
            owner[r] = waiting.popleft()
            by_length.setdefault(len(prompts[owner[r]]), []).append(r)
        for group in by_length.values():
            batch = torch.tensor([prompts[owner[r]] for r in group], device=device)  # (R, L)
            logits = model(batch, cache=cache.rows(group), start_pos=0, logits_at=-1)[:, 0]  # (R, vocab)
            tokens[group] = sample_rows(logits)
        return taken

    fresh = admit(list(range(rows)))  # the rows whose latest token is not yet recorded
    while True:
        latest = tokens.tolist()
        free = []
        for r in fresh:  # record; a finished row takes the next prompt
            tok, i = latest[r], owner[r]
            new[i].append(tok)
            if tok in stop_tokens or len(new[i]) >= max_new_tokens:
                owner[r] = None
                free.append(r)
        if free and waiting:
            fresh = admit(free)  # their first tokens are recorded (and may finish them) before a step
            continue
        if all(i is None for i in owner):
            return new
        tokens = sample_rows(step(tokens))  # idle rows decode too (fixed shapes); their tokens are dropped
        fresh = [r for r in range(rows) if owner[r] is not None]
