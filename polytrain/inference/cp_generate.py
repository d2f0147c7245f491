"""Generation from a prompt longer than one rank holds: prefill and KV cache split over a cp group.

    cp = ContextParallel(groups); cp.apply(model)
    new = generate_cp(model, cp, prompt_ids, max_new_tokens, temperature=0)   # on every cp rank

`polytrain generate|chat|eval needle --parallel.cp N` start N workers (train/launch.py), each
of which loads the run whole, joins the cp group (`join_context_parallel`) and generates
over it; only the KV cache is split, which is what grows with the prompt.

The prompt's first T0 tokens (the largest multiple of the layout's divisor) are prefilled
sharded, through ring / Ulysses attention, into a ShardedKVCache; the remaining < divisor
prompt tokens and then the generated ones run one at a time on every rank with the
sharded decoding attention (distributed/context_parallel/decode.py). The logits of the
last prefilled slot are broadcast from the rank that holds it, and every later step
computes identical logits on every rank, so all ranks sample the same tokens (given the
same seed) and return the same list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from polytrain.backend import get_accelerator
from polytrain.distributed.collectives import broadcast
from polytrain.distributed.context_parallel import ContextParallel
from polytrain.distributed.context_parallel.apply import parallelize_context
from polytrain.distributed.context_parallel.checks import check_context_parallel
from polytrain.distributed.context_parallel.decode import ShardedKVCache
from polytrain.distributed.runtime import Runtime
from polytrain.distributed.topology import ParallelDims
from polytrain.distributed.world import init_world
from polytrain.errors import ConfigError
from polytrain.inference.generate import _check_arguments, _inference, _sample_loop


def generate_cp(model: nn.Module, cp: ContextParallel, prompt: list[int], max_new_tokens: int, *,
                temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                stop_tokens: set[int] | None = None, generator: torch.Generator | None = None) -> list[int]:
    """Continue one prompt by up to max_new_tokens tokens (sampling as inference.generate); new tokens only."""
    _check_arguments([prompt], max_new_tokens, temperature, top_k, top_p)
    total = len(prompt) + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(f"a prompt of {len(prompt)} tokens plus max_new_tokens = {max_new_tokens} exceeds "
                         f"the model's max_seq_len = {model.cfg.max_seq_len}")
    if max_new_tokens == 0:
        return []
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], device=device)  # (1, T)
    size = cp.groups.size
    step_len = cp.layout(0).divisor
    sharded = len(prompt) // step_len * step_len  # T0: the prefix prefilled over the cp group
    cache = ShardedKVCache(1, sharded // size + math.ceil((total - sharded) / size), cp)

    def one_token(tok: torch.Tensor, pos: int) -> torch.Tensor:  # (1, 1) -> logits (1, vocab)
        return model(tok, cache=cache, start_pos=pos)[:, -1]

    with _inference(model, 1, threaded_matmul=True):  # every rank computes the same bits: ranks still agree
        try:
            logits = _prefill(model, cp, tokens[:, :sharded], cache) if sharded else None
            cp.decoding = True
            for pos in range(sharded, len(prompt)):
                logits = one_token(tokens[:, pos:pos + 1], pos)
            new = _sample_loop(logits, lambda tok, i: one_token(tok[:, None], len(prompt) + i), max_new_tokens,
                               temperature, top_k, top_p, stop_tokens, generator)
        finally:
            cp.decoding = False
    return new[0]


def _prefill(model: nn.Module, cp: ContextParallel, tokens: torch.Tensor, cache: ShardedKVCache) -> torch.Tensor:
    """Run the sharded prompt; the logits (1, vocab) of its last slot, on every rank."""
    layout = cp.layout(tokens.shape[1])
    slots = layout.slots(cp.groups.cp_rank).to(tokens.device)
    last = tokens.shape[1] - 1
    owner = next(r for r in range(layout.size) if last in layout.slots(r))
    # the owner's logits of the prompt's last token; the other ranks' (any slot's) are dropped
    at = int((slots == last).nonzero()[0, 0]) if cp.groups.cp_rank == owner else 0
    here = model(cp.shard(tokens), cache=cache, start_pos=0, positions=slots, logits_at=at)[:, 0]  # (1, vocab)
    return broadcast(here.contiguous(), dist.get_global_rank(cp.groups.cp, owner), cp.groups.cp)


def join_context_parallel(model: nn.Module, cp: int, mode: str = "ring", ulysses: int = 1) -> ContextParallel:
    """Join the job the environment describes (cp ranks, e.g. started by train/launch.py) and run
    `model`'s attention over it; one ConfigError line if the degrees do not fit the model."""
    m = model.cfg
    # The prompt's length is free (generate_cp prefills the part the layout can split), so
    # only the degrees and the heads are checked: at a sequence length that always fits.
    check_context_parallel(cp, mode, ulysses, 4 * cp * cp, m.n_heads, m.n_kv_heads or m.n_heads)
    acc = get_accelerator()
    world = init_world(acc)
    if world.world_size != cp:
        raise ConfigError(f"--parallel.cp {cp} needs {cp} processes; this job has {world.world_size}")
    dims = ParallelDims(world_size=cp, dp_replicate=1, dp_shard=1, zero=0, cp=cp, cp_mode=mode, cp_ulysses=ulysses)
    context = ContextParallel(Runtime.create(acc, world, dims).cp)
    parallelize_context(model, context)
    return context


def cp_generate_fn(cp: ContextParallel) -> Callable:
    """A function with inference.generate's contract (a list of prompts) running generate_cp per prompt."""
    def generate_fn(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, **sampling) -> list[list[int]]:
        return [generate_cp(model, cp, prompt, max_new_tokens, **sampling) for prompt in prompts]
    return generate_fn


def shared_lines(lines: Iterable[str] | None) -> Iterator[str]:
    """Rank 0's `lines` (e.g. stdin) on every rank of the job: each line broadcast as it is read."""
    source = iter(lines) if lines is not None else None
    while True:
        box = [next(source, None) if source is not None else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        yield box[0]
