"""Decoding with a static KV cache: one compiled step, rows refilled as they finish.

`generate(..., static_cache=True)` (or `batch_size=` / `compile=`) runs here. Up to
`batch_size` prompts decode at once, each in its own row of a `StaticKVCache`; a row that
emits a stop token or reaches max_new_tokens takes the next waiting prompt (continuous
batching), so a long batch of prompts never waits for its slowest row and the batch stays
full. Every decoding step has the same shapes, one token per row over the whole cache
with a mask, so `compile=True` compiles it once (`torch.compile` of the whole forward,
the sampling outside). Each prompt is prefilled on its own into its row, so a row
computes exactly what its prompt alone would, as the padded batches of `generate` do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.nn as nn

from polytrain.models.common.kv_cache import StaticKVCache

BACKEND = "inductor"
"""torch.compile backend of the decoding step; tests may set "aot_eager" (the graph, no code generation)."""


def decode_step(model: nn.Module, cache: StaticKVCache, compile_: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """tokens (B,), one per row -> logits (B, vocab) of each row's next token; advances the cache."""
    def step(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, None], cache=cache, start_pos=0)[:, -1]  # (B, vocab)
        cache.advance()
        return logits

    return torch.compile(step, backend=BACKEND) if compile_ else step


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

    def admit(r: int) -> None:
        """Prefill the next waiting prompt into row r and sample its first token."""
        i = owner[r] = waiting.popleft()
        prompt = torch.tensor([prompts[i]], device=device)  # (1, L)
        tokens[r] = sample_rows(model(prompt, cache=cache.row(r), start_pos=0)[:, -1])[0]

    for r in range(rows):
        admit(r)
    while True:
        latest = tokens.tolist()
        for r in range(rows):
            while owner[r] is not None:  # record; a finished row takes prompts until one goes on
                tok, i = latest[r], owner[r]
                new[i].append(tok)
                if tok not in stop_tokens and len(new[i]) < max_new_tokens:
                    break
                owner[r] = None
                if waiting:
                    admit(r)
                    latest[r] = int(tokens[r])
        if all(i is None for i in owner):
            return new
        tokens = sample_rows(step(tokens))  # idle rows decode too (fixed shapes); their tokens are dropped
