"""ZeRO stages 1 and 2: replicated compute parameters, sharded fp32 masters and optimizer state.

Every data-parallel rank keeps the whole model (under tensor parallelism: its tp shard of
every weight) as compute parameters and runs forward and backward on them. What is
sharded over the dp ranks:

- stage 1: the fp32 master weights and the optimizer state. Gradients accumulate
  full-size over the micro-batches and are reduce-scattered once, during the last
  micro-batch's backward.
- stage 2: also the gradients. Every micro-batch's backward reduce-scatters
  gradients bucket by bucket as they become ready (overlapping the rest of
  backward), frees each full gradient once it has been copied out, and adds the
  result to this rank's gradient shard.

Precision (`param_dtype`). fp32: compute weights, gradients and shards are fp32 (the
masters duplicate this rank's rows of the weights), gradients accumulate in `param.grad`.
16-bit (bf16/fp16 model states, as in the ZeRO paper): the compute weights and the
gradients autograd makes are 16-bit; the masters and the optimizer state fp32. Gradients
are summed over micro-batches in fp32 (`accum_dtype`, train.grad_accum_dtype), as
Megatron's main_grad and DeepSpeed do: a 16-bit sum loses the small late micro-batches'
low bits (one bf16 Linear: 1.4% relative error after 256 micro-batches, 0.01% summed in
fp32, benchmarks/grad_accum_precision.py). Where a bucket's gradients wait for a later
reduction (stage 1 before the last micro-batch, a pipeline's stage 1 and tied copies) its
post-accumulate-grad hook adds each 16-bit `param.grad` into the bucket's fp32 `main`
(M,) (the local tensors one after another, unpadded; made at first use, kept, zeroed
once its sum is copied out) and frees `param.grad`; stage 2 and every last micro-batch
reduce into an fp32 gradient shard, which sums the micro-batches. Bytes per parameter
and rank (psi parameters, N ranks, Adam), 16-bit states:

    stage 1   2 weights + 4 fp32 sum (2: the 16-bit gradient with one micro-batch a step) + 12/N + 4/N shard
    stage 2   2 weights + 12/N + 4/N shard (+ the fp32 send buffers of two buckets in flight)
    one rank  2 + 4 + 12: the hook adds straight into the fp32 shard (`main` is it; nothing to reduce)

`accum_dtype` = param_dtype (train.grad_accum_dtype = "param") keeps the older memory
saver: `param.grad` accumulates in 16 bits and the shard is 16-bit (2 psi + 2 psi +
14 psi / N at stage 1, 2 psi + 14 psi / N at stage 2). Either way fp32 is used where
precision needs it: the reduce-scatter sums the ranks' gradients in fp32 buffers (the send
buffer is filled by upcasting; 4 bytes per element on the wire, a ring moving
(N - 1) / N of them per rank and reduction), the gradient norm is accumulated in fp32, and
each bucket's shard is used in fp32 for unscaling, clipping and the update (a 16-bit
shard upcast just before its step, one bucket at a time). The updated masters are
rounded to 16 bits before the all-gather, which then moves half the bytes.

Layout. Each parameter's local tensor of shape (d0, ...) is cut along dim 0 into dp
pieces the way `torch.chunk` cuts it: c = ceil(d0 / dp) rows per piece, rank r owns rows
[r*c, min((r+1)*c, d0)) (possibly none). That is DTensor's `Shard(0)` (over a tensor-
parallel shard: FSDP2's layout, see `master_spec`). The inner optimizer steps plain
tensors holding only the local rows (through DTensors it would pay a dispatch per op and
tensor, as much as the arithmetic itself on a small model); `state_dict()` presents the
masters and the optimizer state as DTensors over the same storage, which Distributed
Checkpoint reshards to any other layout. For the collectives every piece is padded to c
rows, and the parameters of one bucket are laid out per rank:

    send buffer (dp, S)   row r = [piece r of p0 | piece r of p1 | ...]   (full gradients, fp32)
    master, grad (S,)     this rank's [piece of p0 | piece of p1 | ...]  (padding stays zero)
    main (M,)             [all of p0 | all of p1 | ...]                  (16-bit states: fp32 sums, unpadded)

The gradient shards exist only while there are gradients: allocated by the first
reduction of a step, dropped by `zero_grad` (one rank summing in fp32: `main`, kept).
After the optimizer steps (bucket by bucket) the master shards are all-gathered back into
the compute parameters.

Where the flat buffers, and so the optimizer state and step, live is the
`ShardStore`'s business (offload.py): on the accelerator, or on the host with
`parallel.offload`. Collectives always run on the accelerator: reduced gradients are
copied to the host shards, updated masters back to the device before the all-gather.
With a single data-parallel rank (offload, or 16-bit states on one device) there is no
mesh: the shards are whole plain tensors and the collectives are copies.

Under a pipeline (`pipelined`) no one announces micro-batches: stage 1 reduces when the
step begins (`_flush`), stage 2 in backward as always, a bucket's second gradient of a
step being the next micro-batch's. Parameters in `keep_full_grads` (a pipeline's tied
copies, whose gradients are summed after backward) sit in buckets reduced only then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from polytrain.backend import host_collectives
from polytrain.backend.base import Accelerator
from polytrain.config import TrainConfig
from polytrain.distributed.bucket_size import choose_bucket_elements
from polytrain.distributed.offload import ShardStore, fresh_state, state_names
from polytrain.distributed.reduce_scatter import start_reduce_scatter
from polytrain.distributed.zero_specs import as_sharded, replicas, tp_group_of
from polytrain.optim.builder import make_optimizer, param_groups
from polytrain.optim.clip import clip_coefficient, global_norm

# Collectives allowed in flight at once: enough to overlap with compute, while the
# transient send/receive buffers stay at about two buckets.
MAX_IN_FLIGHT = 2


def shard_rows(d0: int, dp: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of dim 0 that `rank` owns when d0 rows are chunked over dp ranks."""
    per = math.ceil(d0 / dp)
    start = min(rank * per, d0)
    return start, min(per, d0 - start)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor: a DTensor's local shard (shares storage), or `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Slot:
    """Where one parameter lives inside its bucket."""

    param: nn.Parameter  # the compute parameter: full shape, or a tensor-parallel DTensor
    fqn: str
    offset: int  # start of its piece in the bucket's per-rank buffer (S,)
    piece: int  # padded elements per rank: ceil(d0 / dp) * row
    rows: int  # rows this rank really owns (<= ceil(d0 / dp))
    row: int  # elements per dim-0 row of the local tensor
    main_offset: int = 0  # start of its local tensor in the bucket's fp32 gradient sum `main` (M,)


@dataclass
class Bucket:
    """Parameters reduced together; `master` and `grad` hold this rank's shards of all of them."""

    slots: list[Slot]
    size: int  # S: padded elements per rank
    master: torch.Tensor  # (S,) fp32 master weights (views of it are the master DTensors)
    index: int = 0  # position in the plan (names the store's buffers)
    grad: torch.Tensor | None = None  # (S,) reduced-gradient shard, from the step's first reduction
    deferred: bool = False  # reduced only when the step begins (keep_full_grads)
    main_size: int = 0  # M: elements of the slots' local tensors, unpadded
    main: torch.Tensor | None = None  # (M,) fp32 sum of 16-bit gradients over micro-batches; kept once made
    in_main: bool = False  # this step's gradients so far are summed in `main` (zeroed when they leave it)
    ready: set[int] = field(default_factory=set)  # ids of params whose gradient is final
    launched: bool = False  # reduce-scatter started for the current micro-batch


@dataclass
class CommCounts:
    """Collectives this strategy issued and the bytes of the full (dp x S) buffer each one moves.

    A reduce-scatter done as an all-reduce (reduce_scatter.py) counts as a reduce-scatter.
    """

    reduce_scatter_calls: int = 0
    reduce_scatter_bytes: int = 0
    all_gather_calls: int = 0
    all_gather_bytes: int = 0


def plan_buckets(named: list[tuple[str, nn.Parameter]], bucket_bytes: int, dp: int, rank: int,
                 store: ShardStore | None = None, first_index: int = 0) -> list[Bucket]:
    """Group parameters, in the given order, into buckets of at most `bucket_bytes` of gradient.

    A parameter larger than the limit gets a bucket of its own. `store` places the
    buckets' master buffers (default: zeros on the parameters' device); the buckets are
    numbered from `first_index`.
    """
    store = store or ShardStore()

    def bucket(slots: list[Slot], size: int) -> Bucket:
        device, index = slots[0].param.device, first_index + len(buckets)
        main_size = slots[-1].main_offset + _local(slots[-1].param).numel()
        return Bucket(slots, size, store.master(index, size, device), index, main_size=main_size)

    buckets, slots, size, used, main = [], [], 0, 0, 0
    for fqn, param in named:
        local = _local(param)
        if local.ndim == 0:
            raise ValueError(f"ZeRO shards along dim 0; parameter {fqn} is a scalar")
        nbytes = local.numel() * local.element_size()
        if slots and used + nbytes > bucket_bytes:
            buckets.append(bucket(slots, size))
            slots, size, used, main = [], 0, 0, 0
        row = local[0].numel() if local.shape[0] else math.prod(local.shape[1:])
        per = math.ceil(local.shape[0] / dp)
        slots.append(Slot(param, fqn, size, per * row, shard_rows(local.shape[0], dp, rank)[1], row, main))
        size += per * row
        used += nbytes
        main += local.numel()
    if slots:
        buckets.append(bucket(slots, size))
    return buckets


def split_into_pieces(flat: torch.Tensor, pieces: torch.Tensor) -> None:
    """Copy a full flattened tensor (N,) into its per-rank pieces (dp, piece) and zero their padding.

    Writing every element lets the caller hand in uninitialised memory: zero-filling a
    whole (dp, S) send buffer first would cost one more pass over it per reduction.
    """
    piece = pieces.shape[1]
    full = flat.numel() // piece
    pieces[:full].copy_(flat[: full * piece].view(full, piece))
    if full < pieces.shape[0]:
        rest = flat.numel() - full * piece
        pieces[full, :rest].copy_(flat[full * piece:])
        pieces[full, rest:].zero_()
        pieces[full + 1:].zero_()


def join_pieces(pieces: torch.Tensor, flat: torch.Tensor) -> None:
    """The inverse: fill a full flattened tensor (N,) from padded per-rank pieces (dp, piece)."""
    piece = pieces.shape[1]
    full = flat.numel() // piece
    flat[: full * piece].view(full, piece).copy_(pieces[:full])
    if full < pieces.shape[0]:
        rest = flat.numel() - full * piece
        flat[full * piece:].copy_(pieces[full, :rest])


class ZeroDataParallel:
    """ZeRO stage 1 or 2 over a 1-D data-parallel mesh; the strategy interface of `data_parallel.py`.

    Where things live (`store` decides the device):
    - `buckets[i].master` / `.grad`: flat buffers (S,) with this rank's fp32 master and
      reduced-gradient (`grad_dtype`: fp32 unless accumulating in 16 bits) shards of the
      bucket's parameters; `.main` (M,) the fp32 sum of full 16-bit gradients awaiting reduction (on the device);
    - `masters`: FQN -> plain fp32 parameter (rows, ...) viewing this rank's rows of a `master` buffer;
    - `optimizer`: the inner torch optimizer over `masters`; `optimizer.state` holds
      the sharded optimizer state, plain local tensors shaped like the masters.
    """

    def __init__(self, acc: Accelerator, mesh: DeviceMesh | None, stage: int, bucket_bytes: int,
                 store: ShardStore | None = None, param_dtype: torch.dtype = torch.float32,
                 pipelined: bool = False, tp: int = 1, auto_buckets: bool = False,
                 accum_dtype: torch.dtype = torch.float32):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, not {stage}")
        self.acc, self.mesh, self.stage, self.bucket_bytes = acc, mesh, stage, bucket_bytes
        self.param_dtype, self.pipelined = param_dtype, pipelined
        # What gradients are summed in over micro-batches, and the gradient shards' dtype:
        # fp32 under 16-bit weights unless accum_dtype is their own (train.grad_accum_dtype).
        self.grad_dtype = torch.promote_types(param_dtype, accum_dtype)
        self.main_grads = self.grad_dtype != param_dtype  # 16-bit gradients summed into fp32 `main` buffers
        # auto_buckets: bucket_bytes is only the bound; build_optimizer measures (bucket_size.py).
        self.auto_buckets, self.bucket_choice = auto_buckets, None
        self.tp = tp  # ranks holding a copy of each plain (not tensor-parallel) parameter's rows
        self._hooks: list = []
        self.store = store or ShardStore()
        # mesh None: one data-parallel rank, no process group.
        self.group = mesh.get_group() if mesh is not None else None
        self.rank, self.size = (mesh.get_local_rank(), mesh.size()) if mesh is not None else (0, 1)
        # One rank whose shards live on the device: nothing to reduce, each bucket's fp32
        # sum `main` is its gradient shard (same layout: no padding at dp = 1).
        self._direct = self.main_grads and self.group is None and not self.store.offloaded
        self.by_all_reduce = acc.reduce_scatter_by_all_reduce  # see reduce_scatter.py
        self.device = torch.device("cpu")  # of the compute parameters, set by build_optimizer
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.buckets: list[Bucket] = []
        self.masters: dict[str, nn.Parameter] = {}
        self.keep_full_grads: set[str] = set()  # set before build_optimizer (see the module docstring)
        self.comm = CommCounts()
        self._slot_of: dict[str, Slot] = {}
        self._slot_of_param: dict[int, Slot] = {}
        self._bucket_of: dict[int, Bucket] = {}
        self._pending: list[tuple[dist.Work | None, torch.Tensor, Bucket, torch.Tensor]] = []
        self._grad_factor: torch.Tensor | None = None  # clipping's coefficient, applied at the step
        # Whether gradients produced by backward now are reduced at once (always in
        # stage 2, on the last micro-batch in stage 1). True by default so a caller
        # that never announces micro-batches still gets reduced gradients; a pipeline
        # (which does not announce them) reduces stage 1's when the step begins.
        self._reduce_by_default = not (pipelined and stage == 1)
        self._reducing = self._reduce_by_default

    # ----- set-up -------------------------------------------------------------------

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Before materialisation: the compute parameters stay whole, in `param_dtype`."""
        self.model = model.to(self.param_dtype) if self.param_dtype != torch.float32 else model
        return self.model

    def build_optimizer(self, model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
        """Cut the (materialised) parameters into master shards and build the inner optimizer over them."""
        self.model = model
        # named_parameters lists a tied parameter once, under its first name, as
        # get_state_dict keys its optimizer state. Backward produces gradients
        # roughly in reverse order, so buckets are filled from the end. Frozen
        # parameters (a LoRA base) get no master, gradient or optimizer state.
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.device = named[0][1].device
        eager = [(n, p) for n, p in named[::-1] if n not in self.keep_full_grads]
        later = [(n, p) for n, p in named[::-1] if n in self.keep_full_grads]
        measured = self.auto_buckets and self.group is not None
        bucket_bytes = self._measured_bucket_bytes(eager) if measured else self.bucket_bytes
        self.buckets = plan_buckets(eager, bucket_bytes, self.size, self.rank, self.store)
        deferred = plan_buckets(later, bucket_bytes, self.size, self.rank, self.store, len(self.buckets))
        for bucket in deferred:
            bucket.deferred = True
        self.buckets += deferred
        by_param, by_fqn = {}, {}
        for bucket in self.buckets:
            for slot in bucket.slots:
                by_fqn[slot.fqn] = by_param[id(slot.param)] = self._master_of(bucket, slot)
                self._slot_of[slot.fqn] = self._slot_of_param[id(slot.param)] = slot
                self._bucket_of[id(slot.param)] = bucket
                # Kept to remove in close(): the hook is a bound method held by autograd's
                # C++ side, a cycle the garbage collector cannot see, which would keep the
                # model, masters and optimizer state alive after the run.
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._on_grad_ready))
        self.masters = {fqn: by_fqn[fqn] for fqn, _ in named}  # model order, as in checkpoints
        groups = [{**g, "params": [by_param[id(p)] for p in g["params"]]}
                  for g in param_groups(model, cfg.weight_decay)]
        self.optimizer = make_optimizer(groups, cfg, square_sums=self._whole_square_sums)
        if self.store.maps_state:
            self._map_optimizer_state()
        return self.optimizer

    def _measured_bucket_bytes(self, named: list[tuple[str, nn.Parameter]]) -> int:
        """The bucket size (in the compute parameters' bytes) for the group's measured reduction cost."""
        element = torch.empty((), dtype=self.param_dtype).element_size()
        self.bucket_choice = choose_bucket_elements(
            self.group, self.rank, self.by_all_reduce, self.device,
            n_elements=sum(_local(p).numel() for _, p in named), cap_elements=max(1, self.bucket_bytes // element))
        return self.bucket_choice.elements * element

    def named_optimizer_params(self) -> list[tuple[str, torch.Tensor]]:
        """(FQN, tensor the optimizer steps) pairs: the master shards."""
        return list(self.masters.items())

    @staticmethod
    def _rows(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        """This rank's rows of `slot`'s parameter inside a bucket buffer `flat` (S,), as (rows, ...)."""
        shape = _local(slot.param).shape[1:]
        return flat[slot.offset:slot.offset + slot.rows * slot.row].view(slot.rows, *shape)

    @torch.no_grad()
    def _master_of(self, bucket: Bucket, slot: Slot) -> nn.Parameter:
        """This rank's fp32 master rows of one parameter, filled from the compute parameter."""
        local = _local(slot.param)
        start = shard_rows(local.shape[0], self.size, self.rank)[0]
        master = self._rows(bucket.master, slot)  # (rows, ...)
        master.copy_(local[start:start + slot.rows])
        return nn.Parameter(master)

    def _map_optimizer_state(self) -> None:
        """Give the inner optimizer state that views memory-mapped files, one per bucket and state tensor."""
        names = state_names(self.optimizer)
        for bucket in self.buckets:
            files = {name: self.store.state(bucket.index, name, bucket.size) for name in names}  # (S,) each
            for slot in bucket.slots:
                views = {name: self._rows(flat, slot) for name, flat in files.items()}
                self.optimizer.state[self.masters[slot.fqn]] = fresh_state(self.optimizer, views)

    @torch.no_grad()
    def _whole_square_sums(self, masters: list[torch.Tensor], local: torch.Tensor) -> torch.Tensor:
        """Per-parameter sums of squares (n, k) of the whole tensors, from this rank's rows of each.

        Every master is one parameter's rows, and the dp ranks' rows of it are disjoint
        (padding is never part of a master), so one all-reduce of the (n, k) partial sums
        over the dp group gives each local tensor's sums; a tensor-parallel shard's rows
        are then all-reduced over the tp group too. For LAMB/LARS trust ratios (optim/trust.py).
        """
        total = local.to(self.device)  # collectives run on the accelerator, also when offloaded
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        fqn_of = {id(m): fqn for fqn, m in self.masters.items()}
        split = [i for i, m in enumerate(masters) if tp_group_of(self._slot_of[fqn_of[id(m)]].param)]
        if split:
            group = tp_group_of(self._slot_of[fqn_of[id(masters[split[0]])]].param)
            index = torch.tensor(split, device=total.device)
            part = total.index_select(0, index)
            dist.all_reduce(part, group=group)
            total.index_copy_(0, index, part)
        return total.to(local.device)

    # ----- gradients ----------------------------------------------------------------

    def before_micro_batch(self, model: nn.Module, last: bool) -> None:
        """Finish the previous micro-batch's reductions; decide whether this one's are reduced."""
        if self._reducing:
            self._flush()
        self._reducing = self.stage == 2 or last

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        # Runs inside backward once `param.grad` holds this backward's full gradient.
        bucket = self._bucket_of[id(param)]
        if self._direct:
            self._sum_into_main(bucket, param)
            return
        held = bucket.deferred or not self._reducing  # reduced in a later micro-batch or at the step
        if self.main_grads and (held or bucket.in_main):  # earlier micro-batches' sum is there: add this one
            self._sum_into_main(bucket, param)
        if held:
            return
        if bucket.launched:
            if not self.pipelined:
                raise RuntimeError("a gradient arrived after its ZeRO bucket was reduced (a parameter "
                                   "used in two backward passes of one micro-batch?)")
            self._settle(bucket)  # a schedule's next micro-batch: the last one's reduction first
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.slots):
            self._launch(bucket)

    @torch.no_grad()
    def _sum_into_main(self, bucket: Bucket, param: nn.Parameter) -> None:
        """Add `param`'s 16-bit gradient from this backward into the bucket's fp32 sum, and free it."""
        self._main_view(bucket, self._slot_of_param[id(param)]).add_(_local(param.grad))
        bucket.in_main = True
        param.grad = None

    def _main(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's fp32 sum (M,): made once, at first use, then kept (zeroed when its sum leaves it)."""
        if bucket.main is None:
            bucket.main = torch.zeros(bucket.main_size, dtype=torch.float32, device=self.device)
        return bucket.main

    def _main_view(self, bucket: Bucket, slot: Slot) -> torch.Tensor:
        """`slot`'s parameter's fp32 gradient sum inside the bucket's `main`, shaped like its local tensor."""
        local = _local(slot.param)
        return self._main(bucket)[slot.main_offset:slot.main_offset + local.numel()].view(local.shape)

    def accumulated_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The step's gradient of `param` so far, before reduction: its fp32 sum, or `param.grad`.

        Local shape (a tensor-parallel parameter's shard). In place changes count (the
        pipeline's tied-embedding sum writes into it).
        """
        bucket = self._bucket_of.get(id(param))
        if bucket is not None and bucket.in_main:
            return self._main_view(bucket, self._slot_of_param[id(param)])
        return param.grad

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's reduce-scatter (in fp32) and free its full gradients (or zero their fp32 sum)."""
        send = torch.empty(self.size, bucket.size, dtype=torch.float32, device=self.device)  # (dp, S)
        for slot in bucket.slots:
            if bucket.in_main and slot.param.grad is not None:  # left outside the sum (set by hand)
                self._sum_into_main(bucket, slot.param)
            pieces = send[:, slot.offset:slot.offset + slot.piece]  # (dp, piece)
            grad = self.accumulated_grad(slot.param)
            if grad is None:  # unused in this backward: contributes zeros
                pieces.zero_()
            else:
                split_into_pieces(_local(grad).reshape(-1), pieces)
                slot.param.grad = None
        if bucket.in_main:  # copied out: the next step's sum starts from zero
            bucket.main.zero_()
            bucket.in_main = False
        # recv (S,): the sum of every rank's pieces for this rank, once `work` is done
        work, recv = start_reduce_scatter(send, self.group, self.rank, self.by_all_reduce)
        self.comm.reduce_scatter_calls += 1
        self.comm.reduce_scatter_bytes += send.numel() * send.element_size()
        bucket.launched = True
        self._pending.append((work, recv, bucket, send))
        while len(self._pending) > MAX_IN_FLIGHT:
            self._finish_oldest()

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> dist.Work | None:
        """Start gathering every rank's `inp` (S,) into `out` (dp * S,); one rank only copies."""
        if self.group is None:
            out.copy_(inp)
            return None
        if host_collectives.all_gather_(out, inp, self.group):
            return None  # done at once through shared memory
        return dist.all_gather_single(out, inp, group=self.group, async_op=True)

    def _finish_oldest(self) -> None:
        work, recv, bucket, _send = self._pending.pop(0)  # _send must live until the work is done
        if work is not None:
            work.wait()
        recv.div_(self.size)  # the average over data-parallel ranks, in fp32
        if bucket.grad is None:  # the step's first reduction: the shard starts as it (a copy)
            bucket.grad = self.store.grad(bucket.index, bucket.size, self.device, self.grad_dtype)
            bucket.grad.copy_(recv)  # offloaded, a (blocking) copy to the host shard
        else:  # a later micro-batch's (stage 2): summed in fp32 (rounded each time with "param")
            bucket.grad.add_(recv.to(bucket.grad.device))

    def _settle(self, bucket: Bucket) -> None:
        """Finish reductions up to and including `bucket`'s, and let it be reduced again."""
        while any(item[2] is bucket for item in self._pending):
            self._finish_oldest()
        bucket.launched = False
        bucket.ready.clear()

    def _flush(self) -> None:
        """Reduce whatever gradients backward left (e.g. of unused parameters) and wait for all reductions."""
        for bucket in self.buckets:
            if self._direct:  # the sums are the shards already
                continue
            if not bucket.launched and (bucket.in_main or any(s.param.grad is not None for s in bucket.slots)):
                self._launch(bucket)
        while self._pending:
            self._finish_oldest()
        for bucket in self.buckets:
            bucket.launched = False
            bucket.ready.clear()

    def _finish_backward(self) -> None:
        """All of the step's reductions, done; the next backward starts a new step."""
        self._flush()
        self._reducing = self._reduce_by_default

    def _shard(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's reduced-gradient shard; zeros if none of its parameters had a gradient."""
        if bucket.grad is None and self._direct:  # the fp32 sum itself, zeroed by zero_grad
            bucket.grad, bucket.in_main = self._main(bucket), True
        elif bucket.grad is None:
            bucket.grad = self.store.grad(bucket.index, bucket.size, self.device, self.grad_dtype)
        return bucket.grad

    def gradients(self) -> list[torch.Tensor]:
        """This rank's final gradients, once every reduction is done: each bucket's shard, in fp32.

        For fp16 loss scaling, which unscales them in place: 16-bit shards (grad_accum_dtype
        "param") are upcast here, all at once (2 bytes per sharded parameter more until the step).
        """
        self._finish_backward()
        for bucket in self.buckets:
            bucket.grad = self._shard(bucket).float()
        return [bucket.grad for bucket in self.buckets]

    def _grad_views(self) -> list[tuple[str, torch.Tensor]]:
        """(FQN, this rank's gradient rows) of every parameter."""
        return [(slot.fqn, self._rows(self._shard(bucket), slot)) for bucket in self.buckets for slot in bucket.slots]

    @torch.no_grad()
    def squared_norm_share(self, leave_out=()) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (see optim/clip.py), in fp32.

        The dp ranks' rows are disjoint; a tensor-parallel replica counts 1/replicas on
        each of the ranks holding it. `leave_out`: parameter names not counted.
        """
        self._finish_backward()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for fqn, grad in self._grad_views():
            if fqn not in leave_out:
                square = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
                total += square.to(self.device) / replicas(self._slot_of[fqn].param, self.tp)
        return total

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient by `factor` (clipping by a norm computed elsewhere), at the step."""
        factor = torch.as_tensor(factor, dtype=torch.float32)
        self._grad_factor = factor if self._grad_factor is None else self._grad_factor * factor

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradient shards so their global norm is at most `max_norm`; return the norm before."""
        norm = global_norm(self.squared_norm_share())
        if math.isfinite(max_norm):
            self.scale_gradients(clip_coefficient(norm, max_norm))
        return norm.item()

    # ----- optimizer step -----------------------------------------------------------

    def step(self) -> None:
        """Step the master shards bucket by bucket, then all-gather them into the compute parameters."""
        self._finish_backward()
        if self.store.offloaded:
            # The last gather's asynchronous copies to the device read the host masters this step rewrites.
            self.acc.synchronize()
        for bucket in self.buckets:
            self._step_bucket(bucket)
        self._grad_factor = None
        self._gather_params()

    @torch.no_grad()
    def _step_bucket(self, bucket: Bucket) -> None:
        """The inner optimizer over one bucket's masters, with their gradients upcast and scaled."""
        grad = self._shard(bucket).float()  # (S,); the shard itself when it is fp32 already
        if self._grad_factor is not None:
            grad.mul_(self._grad_factor.to(grad.device))
        masters = [self.masters[slot.fqn] for slot in bucket.slots]
        for master, slot in zip(masters, bucket.slots):
            master.grad = self._rows(grad, slot)
        self.optimizer.step()  # masters of other buckets have no gradient: skipped
        for master in masters:
            master.grad = None

    def zero_grad(self) -> None:
        self._grad_factor = None  # also after a skipped (fp16 overflow) step
        for bucket in self.buckets:
            bucket.grad = None
            if bucket.in_main:  # one rank's shard, or a sum never reduced: the next step starts from zero
                bucket.main.zero_()
                bucket.in_main = False
            for slot in bucket.slots:
                slot.param.grad = None

    @torch.no_grad()
    def _gather_params(self) -> None:
        in_flight = []
        for bucket in self.buckets:
            # Offloaded, the updated host shard goes to the device first (asynchronously
            # from pinned memory); 16-bit weights are gathered in 16 bits.
            send = bucket.master.to(self.device, self.param_dtype, non_blocking=True)  # (S,)
            recv = torch.empty(self.size, bucket.size, dtype=self.param_dtype, device=self.device)
            work = self._all_gather(recv.view(-1), send)
            self.comm.all_gather_calls += 1
            self.comm.all_gather_bytes += recv.numel() * recv.element_size()
            in_flight.append((work, recv, bucket, send))
            if len(in_flight) >= MAX_IN_FLIGHT:
                self._copy_gathered(*in_flight.pop(0))
        for item in in_flight:
            self._copy_gathered(*item)

    @staticmethod
    def _copy_gathered(work: dist.Work | None, recv: torch.Tensor, bucket: Bucket, send: torch.Tensor) -> None:
        if work is not None:  # `send` had to live until now
            work.wait()
        for slot in bucket.slots:  # recv (dp, S) -> each full parameter
            join_pieces(recv[:, slot.offset:slot.offset + slot.piece], _local(slot.param).detach().view(-1))

    # ----- checkpoints --------------------------------------------------------------

    def state_dict(self) -> dict:
        """{"model": FQN -> master DTensor, "optim": {"state": {FQN: ...}, "param_groups": [...]}}.

        The same keys as `get_state_dict(model, optimizer)` gives for the single-process
        or FSDP runs, so Distributed Checkpoint moves state between the layouts. The model
        entry is the fp32 masters (the values the optimizer updates), one shard per rank;
        a tied parameter appears under each of its names, as in `model.state_dict()`.
        The optimizer state's tensors shaped like the masters become DTensors too;
        scalars ("step") stay as torch keeps them. Every DTensor shares storage with the
        local tensor it wraps, so loading into this dict in place loads this rank.
        """
        self._init_optimizer_state()
        sharded = {fqn: self._sharded(master, fqn) for fqn, master in self.masters.items()}
        by_param = {id(self._slot_of[fqn].param): t for fqn, t in sharded.items()}
        model_sd = {name: by_param.get(id(t), t) for name, t in self.model.state_dict(keep_vars=True).items()}
        fqn_of = {id(master): fqn for fqn, master in self.masters.items()}
        groups = self.optimizer.param_groups
        state = {fqn_of[id(m)]: self._sharded_state(fqn_of[id(m)]) for g in groups for m in g["params"]}
        saved_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [fqn_of[id(m)] for m in g["params"]]} for g in groups]
        return {"model": model_sd, "optim": {"state": state, "param_groups": saved_groups}}

    def _sharded(self, local: torch.Tensor, fqn: str) -> DTensor | torch.Tensor:
        return as_sharded(local, self._slot_of[fqn].param, self.mesh)

    def _sharded_state(self, fqn: str) -> dict:
        """One master's optimizer state with its per-element tensors (rows, ...) as sharded DTensors."""
        master = self.masters[fqn]
        return {key: self._sharded(value, fqn) if _per_element(value, master) else value
                for key, value in self.optimizer.state[master].items()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Take the masters and optimizer state from `state_dict` (a filled `state_dict()`), then refresh the model."""
        self._init_optimizer_state()
        model_sd, optim_sd = state_dict["model"], state_dict["optim"]
        for fqn, master in self.masters.items():
            _copy_into(master, model_sd[fqn])
            for key, target in self.optimizer.state[master].items():
                _copy_into(target, optim_sd["state"][fqn][key])
        fqn_of = {id(master): fqn for fqn, master in self.masters.items()}
        for group, saved in zip(self.optimizer.param_groups, optim_sd["param_groups"], strict=True):
            if saved["params"] != [fqn_of[id(m)] for m in group["params"]]:
                raise ValueError("optimizer parameter groups in the state dict do not match this model's")
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._gather_params()

    def _init_optimizer_state(self) -> None:
        """Create the inner optimizer's state (zeros) so a checkpoint can be loaded into it.

        A step with zero gradients at learning rate 0 leaves the masters as they are.
        """
        if self.optimizer.state:
            return
        rates = [g["lr"] for g in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        for master in self.masters.values():
            master.grad = torch.zeros_like(master)
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, rates):
            group["lr"] = lr
        for master in self.masters.values():
            master.grad = None

    def close(self) -> None:
        """Release what outlives the run: the gradient hooks and nvme offload's files."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.store.close()


def _per_element(value, master: torch.Tensor) -> bool:
    """Whether an optimizer-state entry holds one value per element of `master` (e.g. exp_avg, not step)."""
    return isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape == master.shape


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy `value` (a tensor or this rank's DTensor shard of it) into the local `target`."""
    if isinstance(value, DTensor):
        value = value.to_local()
    # Distributed Checkpoint loads in place, so usually `value` already is `target`'s storage.
    if value.data_ptr() != target.data_ptr() or value.shape != target.shape:
        target.copy_(value)
