"""Step 3's generation: responses sampled from the actor, the same tokens at every layout.

Each sample draws from its own generator seeded by (run seed, step, global sample
index), so what sample i of step k says does not depend on which rank generates it,
how many rows share its batch or how the batch is padded. Ranks that generate
through one sharded actor (ZeRO-3, tensor parallel) run the same number of decoding
steps, agreeing through `all_done` when every row of every rank has ended.

The prompts and responses are then laid out right-padded for the scoring passes
(`batches`): `Rollout.ids` (B, T) = prompt + response + padding, `mask` (B, T - 1) the
shifted positions that score response tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from polytrain.inference.generate import generate
from polytrain.models.common.init import seed_for
from polytrain.rlhf.batches import response_mask, right_pad


@dataclass(frozen=True)
class Sampling:
    """How step 3 samples responses."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None


@dataclass
class Rollout:
    """A batch of prompts with their sampled responses, right-padded."""

    ids: torch.Tensor
    """(B, T) prompt + response tokens, then padding."""
    lengths: torch.Tensor
    """(B,) real tokens per row."""
    prompt_lens: torch.Tensor
    """(B,) prompt tokens per row."""
    mask: torch.Tensor
    """(B, T - 1) True where the shifted position scores a response token."""

    @property
    def response_lens(self) -> torch.Tensor:
        return self.lengths - self.prompt_lens

    def responses(self) -> list[list[int]]:
        """Each row's response tokens."""
        return [row[p:n] for row, p, n in zip(self.ids.tolist(), self.prompt_lens.tolist(), self.lengths.tolist())]


def sample_generators(seed: int, step: int, sample_ids: Sequence[int],
                      device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per sample, seeded by (seed, step, global sample index)."""
    return [torch.Generator(device=device).manual_seed(seed_for(seed, f"rollout/{step}/{i}")) for i in sample_ids]


def rollout(actor: nn.Module, prompts: Sequence[list[int]], sample_ids: Sequence[int], *, step: int,
            seed: int, sampling: Sampling, stop_tokens: set[int], pad_id: int,
            all_done: Callable[[bool], bool] | None = None) -> Rollout:
    """Sample a response to each prompt (prompt b is global sample sample_ids[b]) and lay them out."""
    device = next(actor.parameters()).device
    new = generate(actor, list(prompts), sampling.max_new_tokens, temperature=sampling.temperature,
                   top_k=sampling.top_k, top_p=sampling.top_p, stop_tokens=stop_tokens,
                   row_generators=sample_generators(seed, step, sample_ids, device), all_done=all_done)
    ids, lengths = right_pad([list(p) + r for p, r in zip(prompts, new)], pad_id)
    prompt_lens = torch.tensor([len(p) for p in prompts])
    return Rollout(ids, lengths, prompt_lens, response_mask(prompt_lens, lengths, ids.shape[1]))
