"""Regional compilation: `torch.compile` each transformer block, not the whole model.

Every block of a model is an instance of the same class running the same code on
same-shaped tensors, so dynamo traces the first block once and the others reuse its
graph (with `inline_inbuilt_nn_modules`, torch's default, parameters are graph inputs,
not constants): compile time is one block's, whatever the depth. Parallel layouts keep
working because each one touches the block from the right side:

- tensor / sequence parallelism rewires the block's submodules first; their collectives
  (copy / reduce / gather / reduce-scatter regions) are traced into the block's graph as
  functional collectives, or, for CPU ranks on x86-64, as calls of the shared-memory
  operators (backend/host_collective_ops.py) that eager blocks use too;
- activation checkpointing wraps the block's (or its attention core's) forward first; the
  compiled graph holds the recomputation;
- FSDP2 (ZeRO-3, replicas) shards the compiled block afterwards: its all-gather and
  reduce-scatter hooks run around the block's call, outside the graph; ZeRO-1/2 and the
  pipeline's sends see plain modules;
- the chunked loss is the output head's, outside every block; its per-chunk softmax and
  softmax gradient are two small compiled kernels of their own (distributed/linear_cross_entropy.py).

A forward with a KV cache (generation) runs the block eagerly: the decode loop has its
own compiled step (inference/generate.py). The block's `forward` is replaced on the
instance, so module and parameter names (and checkpoints) are unchanged.

    n = compile_blocks(model)            # before data parallelism; each pipeline stage alike
    timer = CompileTimer.started(n)      # counts this process's compilations from now on
    ...first step...
    timer.describe()                     # "compiled 2 blocks: 3 new graph(s), 0 graph breaks, 14.2 s compiling"
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch._dynamo import callback as dynamo_callback
from torch._dynamo.utils import counters

BACKEND = "inductor"
"""torch.compile backend for the blocks; tests may set "aot_eager" (same graphs, no code generation)."""


@dataclass
class CompileTimer:
    """Wall time spent compiling (dynamo frames and lazily compiled backward graphs) since `start`."""

    blocks: int = 0
    seconds: float = 0.0
    _started: list[float] = field(default_factory=list, repr=False)
    _graphs0: int = 0
    _breaks0: int = 0

    @classmethod
    def started(cls, blocks: int) -> "CompileTimer":
        """A timer of every compilation in this process from now on, for `blocks` compiled blocks."""
        timer = cls(blocks=blocks)
        timer.start()
        return timer

    def start(self) -> None:
        """Count compile time and graphs from now on (process-wide)."""
        self._graphs0 = counters["stats"]["unique_graphs"]
        self._breaks0 = graph_breaks()
        dynamo_callback.callback_handler.register_start_callback(self._on_start)
        dynamo_callback.callback_handler.register_end_callback(self._on_end)

    def stop(self) -> None:
        dynamo_callback.callback_handler.remove_start_callback(self._on_start)
        dynamo_callback.callback_handler.remove_end_callback(self._on_end)

    def _on_start(self, _args) -> None:
        self._started.append(time.perf_counter())

    def _on_end(self, _args) -> None:
        if self._started:
            self.seconds += time.perf_counter() - self._started.pop()

    @property
    def graphs(self) -> int:
        """Graphs compiled since `start` (all blocks of one shape and mode share one; the chunked
        loss adds its two kernels, and one more each for a smaller last chunk)."""
        return counters["stats"]["unique_graphs"] - self._graphs0

    @property
    def breaks(self) -> int:
        """Graph breaks dynamo met since `start` (0 for every model of the zoo)."""
        return graph_breaks() - self._breaks0

    def describe(self) -> str:
        return (f"compiled {self.blocks} blocks: {self.graphs} new graph(s), {self.breaks} graph breaks, "
                f"{self.seconds:.1f} s compiling")


def graph_breaks() -> int:
    """Graph breaks dynamo has met in this process (all reasons)."""
    return sum(counters["graph_break"].values())


def compiled_backend() -> str:
    """The backend compiled code uses (BACKEND, read at call time so tests can set it)."""
    return BACKEND


def compile_blocks(model: nn.Module, backend: str | None = None) -> int:
    """Compile each block of `model.layers` (a pipeline stage: the blocks it holds) in place;
    returns how many. Call after tensor parallelism and activation checkpointing, before
    data parallelism. Compilation itself happens at each graph's first call."""
    for block in model.layers.values():
        block.forward = _compiled_forward(block, backend or compiled_backend())
    return len(model.layers)


def _compiled_forward(block: nn.Module, backend: str) -> Callable:
    eager = block.forward  # the class's, or what tp / activation checkpointing put there
    # Tensor parallelism's norms swap their DTensor parameters for local tensors and back
    # within one call: a side effect with no net change, so activation checkpointing's
    # recomputation need not replay it (dynamo refuses it inside a checkpoint otherwise).
    no_replay = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    compiled = no_replay(torch.compile(eager, backend=backend))
    # The class's signature tells where the KV cache argument is, whatever wraps `eager`.
    names = list(inspect.signature(type(block).forward).parameters)[1:]  # without self
    at = names.index("cache") if "cache" in names else None

    @functools.wraps(eager)
    def forward(*args, **kwargs):
        if at is not None and (args[at] if len(args) > at else kwargs.get("cache")) is not None:
            return eager(*args, **kwargs)  # decoding: shapes change every step
        return compiled(*args, **kwargs)

    return forward
