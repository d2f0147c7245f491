"""Step 3's generation: responses sampled from the actor, the same tokens at every layout.

    generation = TrainingLayoutGeneration(actor.model, sampling, stop_tokens, seed, autocast)
    generation = HybridEngineGeneration(HybridEngine(runtime, cfg, actor.model), sampling, stop_tokens, seed)
    responses = generation(prompts, sample_ids, step)      # this rank's rows of the global batch
    rollout = lay_out(all_prompts, all_responses, pad_id)  # the whole batch, right-padded

`Generation` is the seam step 3 samples through (`PPOEngine.generation`): anything that
maps (prompts, their global sample indices, the step) to response tokens can replace the
training-layout one, which decodes through the actor as it is laid out for training (every
ZeRO-3 block gathered for every token). `HybridEngineGeneration` (rlhf.hybrid_engine, the
default in `polytrain rlhf`) is such a replacement: it gathers the weights once per rollout,
generates in an inference layout and hands the same tokens back.

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

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ContextManager, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from polytrain.inference.generate import generate
from polytrain.inference.hybrid_engine import HybridEngine
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

    def to(self, device: torch.device | str) -> Rollout:
        return Rollout(self.ids.to(device), self.lengths.to(device), self.prompt_lens.to(device), self.mask.to(device))

    def rows(self, index: range | slice) -> Rollout:
        """The rollout of some of the rows (a rank's data-parallel slice, a micro-batch)."""
        return Rollout(self.ids[index], self.lengths[index], self.prompt_lens[index], self.mask[index])


class Generation(Protocol):
    """Step 3's sampling seam: responses (new tokens, stop token included) to this rank's prompts."""

    def __call__(self, prompts: Sequence[list[int]], sample_ids: Sequence[int], step: int | str) -> list[list[int]]: ...


def sample_seeds(seed: int, step: int | str, sample_ids: Sequence[int]) -> list[int]:
    """One generator seed per sample, from (seed, step, global sample index)."""
    return [seed_for(seed, f"rollout/{step}/{i}") for i in sample_ids]


def sample_generators(seed: int, step: int | str, sample_ids: Sequence[int],
                      device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per sample, seeded by `sample_seeds`."""
    return [torch.Generator(device=device).manual_seed(s) for s in sample_seeds(seed, step, sample_ids)]


def all_ranks_done(device: torch.device) -> Callable[[bool], bool]:
    """generate's all_done: True when every rank's rows have ended, so ranks decoding through one
    sharded model run the same forwards and stop together."""
    def done(local: bool) -> bool:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local
        flag = torch.tensor([0 if local else 1], device=device)
        dist.all_reduce(flag)  # the ranks still decoding
        return flag.item() == 0
    return done


@dataclass
class TrainingLayoutGeneration:
    """The default Generation: KV-cached sampling through the actor in its training layout."""

    actor: nn.Module
    sampling: Sampling
    stop_tokens: set[int]
    seed: int
    autocast: Callable[[], ContextManager] = contextlib.nullcontext

    def __call__(self, prompts: Sequence[list[int]], sample_ids: Sequence[int], step: int | str) -> list[list[int]]:
        s = self.sampling
        device = next(self.actor.parameters()).device
        with self.autocast():
            return generate(self.actor, list(prompts), s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                            top_p=s.top_p, stop_tokens=self.stop_tokens,
                            row_generators=sample_generators(self.seed, step, sample_ids, device),
                            all_done=all_ranks_done(device))


@dataclass
class HybridEngineGeneration:
    """Generation through the Hybrid Engine (rlhf.hybrid_engine): once per rollout the actor is
    gathered out of its training layout (a group of blocks at a time, LoRA fused) into a plain
    or inference-tp copy, which samples with the KV cache over the left-padded prompts and is
    then released. Each sample keeps its seeded generator, so the tokens are those of
    TrainingLayoutGeneration; no collective runs per token (the copy is whole, or its tp group
    decodes the same rows)."""

    engine: HybridEngine
    sampling: Sampling
    stop_tokens: set[int]
    seed: int
    autocast: Callable[[], ContextManager] = contextlib.nullcontext

    @property
    def phases(self) -> dict[str, dict[str, float]]:
        """The last rollout's gather and generate phases: seconds, peak memory (GiB)."""
        return self.engine.phases

    def __call__(self, prompts: Sequence[list[int]], sample_ids: Sequence[int], step: int | str) -> list[list[int]]:
        s = self.sampling
        with self.autocast():
            return self.engine.generate(list(prompts), s.max_new_tokens, sample_seeds(self.seed, step, sample_ids),
                                        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                        stop_tokens=self.stop_tokens)


def lay_out(prompts: Sequence[list[int]], responses: Sequence[list[int]], pad_id: int) -> Rollout:
    """Prompts and their responses as one right-padded Rollout."""
    ids, lengths = right_pad([list(p) + list(r) for p, r in zip(prompts, responses)], pad_id)
    prompt_lens = torch.tensor([len(p) for p in prompts])
    return Rollout(ids, lengths, prompt_lens, response_mask(prompt_lens, lengths, ids.shape[1]))
