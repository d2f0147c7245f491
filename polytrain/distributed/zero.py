"""ZeRO stages 1 and 2: replicated compute parameters, sharded fp32 masters and optimizer state.

Every data-parallel rank keeps the whole model as plain tensors and runs forward
and backward on it. What is sharded over the dp ranks:

- stage 1: the fp32 master weights and the optimizer state. Gradients accumulate
  full-size in `param.grad` over the micro-batches and are reduce-scattered once,
  during the last micro-batch's backward.
- stage 2: also the gradients. Every micro-batch's backward reduce-scatters
  gradients bucket by bucket as they become ready (overlapping the rest of
  backward), frees each full gradient once it has been copied out, and adds the
  result to this rank's fp32 gradient shard.

Layout. Each parameter of shape (d0, ...) is cut along dim 0 into dp pieces the
way `torch.chunk` cuts it: c = ceil(d0 / dp) rows per piece, rank r owns rows
[r*c, min((r+1)*c, d0)) (possibly none). That is exactly DTensor's `Shard(0)`. The
inner optimizer steps plain tensors holding only the local rows (through DTensors
it would pay a dispatch per op and tensor, as much as the arithmetic itself on a
small model); `state_dict()` presents the masters and the optimizer state as
`Shard(0)` DTensors over the same storage, which Distributed Checkpoint reshards to
any other layout. For the collectives every piece is padded to c rows, and the
parameters of one bucket are laid out per rank:

    send buffer (dp, S)   row r = [piece r of p0 | piece r of p1 | ...]   (full gradients)
    master, grad (S,)     this rank's [piece of p0 | piece of p1 | ...]  (padding stays zero)

After the inner optimizer step the master shards are all-gathered back into the
compute parameters.

Where the flat buffers, and so the optimizer state and step, live is the
`ShardStore`'s business (offload.py): on the accelerator, or on the host with
`parallel.offload`. Collectives always run on the accelerator: reduced gradients are
copied to the host shards, updated masters back to the device before the all-gather.
With a single data-parallel rank (offload on one device) there is no mesh: the shards
are whole plain tensors and the collectives are copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from polytrain.backend.base import Accelerator
from polytrain.config import TrainConfig
from polytrain.distributed.offload import ShardStore, fresh_state, state_names
from polytrain.distributed.reduce_scatter import start_reduce_scatter
from polytrain.optim.builder import make_optimizer, param_groups
from polytrain.optim.clip import clip_coefficient, sharded_grad_norm

# Collectives allowed in flight at once: enough to overlap with compute, while the
# transient send/receive buffers stay at about two buckets.
MAX_IN_FLIGHT = 2


def shard_rows(d0: int, dp: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of dim 0 that `rank` owns when d0 rows are chunked over dp ranks."""
    per = math.ceil(d0 / dp)
    start = min(rank * per, d0)
    return start, min(per, d0 - start)


@dataclass
class Slot:
    """Where one parameter lives inside its bucket."""

    param: nn.Parameter  # the replicated compute parameter, full shape
    fqn: str
    offset: int  # start of its piece in the bucket's per-rank buffer (S,)
    piece: int  # padded elements per rank: ceil(d0 / dp) * row
    rows: int  # rows this rank really owns (<= ceil(d0 / dp))
    row: int  # elements per dim-0 row


@dataclass
class Bucket:
    """Parameters reduced together; `master` and `grad` hold this rank's shards of all of them."""

    slots: list[Slot]
    size: int  # S: padded elements per rank
    master: torch.Tensor  # (S,) fp32 master weights (views of it are the master DTensors)
    grad: torch.Tensor  # (S,) fp32 reduced-gradient shard, accumulated over micro-batches
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
                 store: ShardStore | None = None) -> list[Bucket]:
    """Group parameters, in the given order, into buckets of at most `bucket_bytes` of gradient.

    A parameter larger than the limit gets a bucket of its own. `store` places the
    buckets' buffers (default: zeros on the parameters' device).
    """
    store = store or ShardStore()

    def bucket(slots: list[Slot], size: int) -> Bucket:
        device, index = slots[0].param.device, len(buckets)
        return Bucket(slots, size, store.master(index, size, device), store.grad(index, size, device))

    buckets, slots, size, used = [], [], 0, 0
    for fqn, param in named:
        if param.ndim == 0:
            raise ValueError(f"ZeRO shards along dim 0; parameter {fqn} is a scalar")
        nbytes = param.numel() * param.element_size()
        if slots and used + nbytes > bucket_bytes:
            buckets.append(bucket(slots, size))
            slots, size, used = [], 0, 0
        row = param[0].numel()
        per = math.ceil(param.shape[0] / dp)
        slots.append(Slot(param, fqn, size, per * row, shard_rows(param.shape[0], dp, rank)[1], row))
        size += per * row
        used += nbytes
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

    Where things live (what mixed precision would swap; `store` decides the device):
    - `buckets[i].master` / `.grad`: flat fp32 buffers (S,) with this rank's master
      and reduced-gradient shards of the bucket's parameters;
    - `masters`: FQN -> plain parameter (rows, ...) viewing this rank's rows of a `master`
      buffer (its `.grad` views the `grad` buffer);
    - `optimizer`: the inner torch optimizer over `masters`; `optimizer.state` holds
      the sharded optimizer state, plain local tensors shaped like the masters.
    """

    def __init__(self, acc: Accelerator, mesh: DeviceMesh | None, stage: int, bucket_bytes: int,
                 store: ShardStore | None = None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, not {stage}")
        self.acc, self.mesh, self.stage, self.bucket_bytes = acc, mesh, stage, bucket_bytes
        self._hooks: list = []
        self.store = store or ShardStore()
        # mesh None: one data-parallel rank, no process group.
        self.group = mesh.get_group() if mesh is not None else None
        self.rank, self.size = (mesh.get_local_rank(), mesh.size()) if mesh is not None else (0, 1)
        self.by_all_reduce = acc.reduce_scatter_by_all_reduce  # see reduce_scatter.py
        self.device = torch.device("cpu")  # of the compute parameters, set by build_optimizer
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.buckets: list[Bucket] = []
        self.masters: dict[str, nn.Parameter] = {}
        self.comm = CommCounts()
        self._master_grads: list[tuple[nn.Parameter, torch.Tensor]] = []  # (rows, ...) each
        self._slot_of: dict[str, Slot] = {}
        self._bucket_of: dict[int, Bucket] = {}
        self._pending: list[tuple[dist.Work | None, torch.Tensor, Bucket, torch.Tensor]] = []
        # Whether gradients produced by backward now are reduced at once (always in
        # stage 2, on the last micro-batch in stage 1). True by default so a caller
        # that never announces micro-batches still gets reduced gradients.
        self._reducing = True

    # ----- set-up -------------------------------------------------------------------

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Nothing to do before materialisation: compute parameters stay whole on every rank."""
        self.model = model
        return model

    def build_optimizer(self, model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
        """Cut the (materialised) parameters into master shards and build the inner optimizer over them."""
        self.model = model
        # named_parameters lists a tied parameter once, under its first name, as
        # get_state_dict keys its optimizer state. Backward produces gradients
        # roughly in reverse order, so buckets are filled from the end.
        named = list(model.named_parameters())
        self.device = named[0][1].device
        self.buckets = plan_buckets(named[::-1], self.bucket_bytes, self.size, self.rank, self.store)
        by_param, by_fqn = {}, {}
        for bucket in self.buckets:
            for slot in bucket.slots:
                master, grad = self._shard_views(bucket, slot)
                by_fqn[slot.fqn] = by_param[id(slot.param)] = master
                self._master_grads.append((master, grad))
                self._slot_of[slot.fqn] = slot
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

    @staticmethod
    def _rows(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        """This rank's rows of `slot`'s parameter inside a bucket buffer `flat` (S,), as (rows, ...)."""
        return flat[slot.offset:slot.offset + slot.rows * slot.row].view(slot.rows, *slot.param.shape[1:])

    @torch.no_grad()
    def _shard_views(self, bucket: Bucket, slot: Slot) -> tuple[nn.Parameter, torch.Tensor]:
        """This rank's master (filled from the compute parameter) and gradient rows of one parameter."""
        start = shard_rows(slot.param.shape[0], self.size, self.rank)[0]
        master = self._rows(bucket.master, slot)  # (rows, ...)
        master.copy_(slot.param[start:start + slot.rows])
        return nn.Parameter(master), self._rows(bucket.grad, slot)

    def _map_optimizer_state(self) -> None:
        """Give the inner optimizer state that views memory-mapped files, one per bucket and state tensor."""
        names = state_names(self.optimizer)
        for index, bucket in enumerate(self.buckets):
            files = {name: self.store.state(index, name, bucket.size) for name in names}  # (S,) each
            for slot in bucket.slots:
                views = {name: self._rows(flat, slot) for name, flat in files.items()}
                self.optimizer.state[self.masters[slot.fqn]] = fresh_state(self.optimizer, views)

    def _as_dtensor(self, local: torch.Tensor, like: torch.Tensor) -> DTensor | torch.Tensor:
        """This rank's rows `local` as a `Shard(0)` DTensor with the global shape of `like` (shares storage).

        Built from its spec: `DTensor.from_local` would copy a host (offloaded) shard to
        the mesh's device. FSDP2's CPU offload builds its sharded parameters the same way.
        Without a mesh the rows are the whole tensor and stay plain.
        """
        if self.mesh is None:
            return local
        stride = torch.empty(like.shape, device="meta").stride()  # contiguous, of the global shape
        spec = DTensorSpec(self.mesh, (Shard(0),), TensorMeta(like.shape, stride, local.dtype))
        return DTensor(local, spec, requires_grad=False)

    @torch.no_grad()
    def _whole_square_sums(self, masters: list[torch.Tensor], local: torch.Tensor) -> torch.Tensor:
        """Per-parameter sums of squares (n, k) of the whole tensors, from this rank's rows of each.

        Every master is one parameter's rows, and the dp ranks' rows of it are disjoint
        (padding is never part of a master), so one all-reduce of the (n, k) partial sums
        over the dp group gives the whole tensors' sums for all n parameters at once.
        For LAMB/LARS trust ratios (optim/trust.py).
        """
        if self.group is None:
            return local
        total = local.to(self.device)  # collectives run on the accelerator, also when offloaded
        dist.all_reduce(total, group=self.group)
        return total.to(local.device)

    # ----- gradients ----------------------------------------------------------------

    def before_micro_batch(self, model: nn.Module, last: bool) -> None:
        """Finish the previous micro-batch's reductions; decide whether this one's are reduced."""
        if self._reducing:
            self._flush()
        self._reducing = self.stage == 2 or last

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        # Runs inside backward once `param.grad` holds this backward's full gradient.
        if not self._reducing:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            raise RuntimeError("a gradient arrived after its ZeRO bucket was reduced (a parameter "
                               "used in two backward passes of one micro-batch?)")
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.slots):
            self._launch(bucket)

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's reduce-scatter and free its full gradients."""
        send = torch.empty(self.size, bucket.size, dtype=bucket.grad.dtype, device=self.device)  # (dp, S)
        for slot in bucket.slots:
            pieces = send[:, slot.offset:slot.offset + slot.piece]  # (dp, piece)
            if slot.param.grad is None:  # unused in this backward: contributes zeros
                pieces.zero_()
            else:
                split_into_pieces(slot.param.grad.reshape(-1), pieces)
                slot.param.grad = None
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
        return dist.all_gather_single(out, inp, group=self.group, async_op=True)

    def _finish_oldest(self) -> None:
        work, recv, bucket, _send = self._pending.pop(0)  # _send must live until the work is done
        if work is not None:
            work.wait()
        # The average over data-parallel ranks; offloaded, a (blocking) copy to the host shard.
        bucket.grad.add_(recv.div_(self.size).to(bucket.grad.device))

    def _flush(self) -> None:
        """Reduce whatever gradients backward left (e.g. of unused parameters) and wait for all reductions."""
        for bucket in self.buckets:
            if not bucket.launched and any(s.param.grad is not None for s in bucket.slots):
                self._launch(bucket)
        while self._pending:
            self._finish_oldest()
        for bucket in self.buckets:
            bucket.launched = False
            bucket.ready.clear()

    def gradients(self) -> list[torch.Tensor]:
        """This rank's final gradients, once every reduction is done: the fp32 shards of each bucket."""
        self._flush()
        self._reducing = True
        return [bucket.grad for bucket in self.buckets]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradient shards so their global norm is at most `max_norm`; return the norm before."""
        self._flush()
        self._reducing = True
        norm = sharded_grad_norm([g for _, g in self._master_grads], self.group, self.device)
        if math.isfinite(max_norm):
            coef = clip_coefficient(norm, max_norm)
            for bucket in self.buckets:
                bucket.grad.mul_(coef.to(bucket.grad.device))
        return norm.item()

    # ----- optimizer step -----------------------------------------------------------

    def step(self) -> None:
        """Step the master shards, then all-gather them into the compute parameters."""
        self._flush()
        self._reducing = True
        for master, grad in self._master_grads:
            master.grad = grad  # re-attached: an inner zero_grad(set_to_none) would have dropped them
        if self.store.offloaded:
            # The last gather's asynchronous copies to the device read the host masters this step rewrites.
            self.acc.synchronize()
        self.optimizer.step()
        self._gather_params()

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.grad.zero_()
            for slot in bucket.slots:
                slot.param.grad = None

    @torch.no_grad()
    def _gather_params(self) -> None:
        in_flight = []
        for bucket in self.buckets:
            # Offloaded, the updated host shard goes to the device first (asynchronously from pinned memory).
            send = bucket.master.to(self.device, non_blocking=True)  # (S,)
            recv = torch.empty(self.size, bucket.size, dtype=bucket.master.dtype, device=self.device)
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
            join_pieces(recv[:, slot.offset:slot.offset + slot.piece], slot.param.detach().view(-1))

    # ----- checkpoints --------------------------------------------------------------

    def state_dict(self) -> dict:
        """{"model": FQN -> master DTensor, "optim": {"state": {FQN: ...}, "param_groups": [...]}}.

        The same keys as `get_state_dict(model, optimizer)` gives for the single-process
        or FSDP runs, so Distributed Checkpoint moves state between the layouts. The model
        entry is the fp32 masters (the values the optimizer updates), one `Shard(0)` piece
        per rank; a tied parameter appears under each of its names, as in `model.state_dict()`.
        The optimizer state's tensors shaped like the masters become `Shard(0)` DTensors
        too; scalars ("step") stay as torch keeps them. Every DTensor shares storage with
        the local tensor it wraps, so loading into this dict in place loads this rank.
        """
        self._init_optimizer_state()
        sharded = {fqn: self._as_dtensor(master, self._slot_of[fqn].param)
                   for fqn, master in self.masters.items()}
        by_param = {id(self._slot_of[fqn].param): t for fqn, t in sharded.items()}
        model_sd = {name: by_param.get(id(t), t) for name, t in self.model.state_dict(keep_vars=True).items()}
        fqn_of = {id(master): fqn for fqn, master in self.masters.items()}
        groups = self.optimizer.param_groups
        state = {fqn_of[id(m)]: self._sharded_state(fqn_of[id(m)]) for g in groups for m in g["params"]}
        saved_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [fqn_of[id(m)] for m in g["params"]]} for g in groups]
        return {"model": model_sd, "optim": {"state": state, "param_groups": saved_groups}}

    def _sharded_state(self, fqn: str) -> dict:
        """One master's optimizer state with its per-element tensors (rows, ...) as `Shard(0)` DTensors."""
        master, like = self.masters[fqn], self._slot_of[fqn].param
        return {key: self._as_dtensor(value, like) if _per_element(value, master) else value
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
        for master, _ in self._master_grads:
            master.grad = torch.zeros_like(master)
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, rates):
            group["lr"] = lr
        for master, grad in self._master_grads:
            master.grad = grad

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
    """Copy `value` (a tensor or this rank's `Shard(0)` DTensor of it) into the local `target`."""
    if isinstance(value, DTensor):
        value = value.to_local()
    # Distributed Checkpoint loads in place, so usually `value` already is `target`'s storage.
    if value.data_ptr() != target.data_ptr() or value.shape != target.shape:
        target.copy_(value)
