"""Strict collectives: the GPU collective library's (NCCL's) rules, checked on any backend.

gloo forgives what NCCL does not: it matches point-to-point transfers by tag, lets two ranks
each send to the other before receiving, and a collective issued in a different order on two
ranks often still completes (with wrong numbers). On GPUs the same code hangs or corrupts.
With POLYTRAIN_STRICT_COLLECTIVES=1 in the environment, `install()` (called by `init_world`
and by the tests' ranks, before the process group starts) wraps the torch.distributed
functions, polytrain's shared-memory collectives and `Work.wait`, and raises
`StrictCollectiveError` naming the operation, the rank, the peer or group and the rule where
a program:

  a. lets an unbatched transfer with a peer face an unbatched transfer in the same direction:
     NCCL runs a rank's unbatched transfers with one peer one after the other and matches sends
     to receives by posting order, so where rank A's k-th transfer with B and B's k-th with A
     are both sends (or both receives) each waits for the other and they hang once messages
     outgrow its buffers (NVIDIA/nccl#479: a ring of two ranks doing isend, then irecv). Each
     transfer's direction is posted, numbered per peer, to the job's key-value store and
     compared with the peer's at wait() (after a blocking send/recv): a transfer inside a
     `batch_isend_irecv` runs together with the rest of its batch and is never at fault;
  b. uses a point-to-point tag other than 0 (NCCL ignores tags: transfers match by posting order);
  c. issues a group's collectives in different orders on different ranks: each call's
     fingerprint (kind, dtype and shape of its tensors, reduce op, root) is posted, numbered per
     group, and each rank compares it with the next rank of the group's, before a blocking call
     is issued or at wait() of an asynchronous one (where gloo's call would wait for the peers
     anyway, so the check adds no wait of its own);
  d. changes a tensor of an asynchronous collective or transfer between issuing it and wait()
     (its version counter is compared).

The posts go through the store's queues (one per rank and group, one per pair of ranks),
each popped by the one rank that compares it, so the store holds only what is in flight:
about two store round trips per collective or transfer (0.1-0.3 ms on one host).

Not caught: the order of calls across different groups (each group is checked on its own),
two calls that differ only in their values or in which same-shaped tensor they pass, a
send's size against its receive's, functional collectives (DTensor's redistributions,
compiled graphs' collective operators) and anything issued from C++, and an asynchronous
call never waited on until the group's next blocking call.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from polytrain.backend import host_collectives
from polytrain.errors import PolytrainError

ENV = "POLYTRAIN_STRICT_COLLECTIVES"
PATIENCE_S = 1.0
"""How long a rank waits for the next rank's post before a blocking collective; then it enters
the call and compares after (so a rank that hangs elsewhere is seen as the one not entering)."""

# Which arguments of each collective must agree across the group's ranks (the fingerprint).
# Lists that only the root passes (gather_list, scatter_list) and per-rank objects are left out.
COLLECTIVES: dict[str, tuple[str, ...]] = {
    "all_reduce": ("tensor", "op"),
    "all_reduce_coalesced": ("tensors", "op"),
    "broadcast": ("tensor", "src", "group_src"),
    "reduce": ("tensor", "dst", "group_dst", "op"),
    "all_gather": ("tensor_list", "tensor"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor"),
    "all_gather_single": ("output_tensor", "input_tensor"),
    "_all_gather_base": ("output_tensor", "input_tensor"),
    "reduce_scatter": ("output", "input_list", "op"),
    "reduce_scatter_tensor": ("output", "input", "op"),
    "reduce_scatter_single": ("output", "input", "op"),
    "_reduce_scatter_base": ("output", "input", "op"),
    "all_to_all": (),  # per-pair sizes may differ: kind and dtypes only (see _fingerprint)
    "all_to_all_single": ("output", "input"),  # without split sizes, else dtypes only
    "gather": ("tensor", "dst", "group_dst"),
    "scatter": ("tensor", "src", "group_src"),
    "barrier": (),
    "monitored_barrier": (),
    "all_gather_object": (),
    "broadcast_object_list": ("src", "group_src"),
    "gather_object": ("dst", "group_dst"),
    "scatter_object_list": ("src", "group_src"),
}
# Arguments a collective only writes: the process group itself writes them before wait() (gloo's
# all-gather and reduce-scatter copy their results in through ATen, which bumps `_version`), so
# their versions cannot tell a user's write from the library's. Inputs and in-place tensors
# (all_reduce's, broadcast's) are checked.
OUTPUTS = ("output_tensor", "output", "tensor_list", "output_tensor_list")
SENDS, RECEIVES = ("send", "isend"), ("recv", "irecv")
HOST = ("all_reduce_", "all_reduce", "all_gather_", "reduce_scatter_", "all_to_all_")  # host_collectives'

RULE_ORDER = ("NCCL matches a group's collectives by their order, so every rank of the group must issue "
              "the same collectives (kind, dtype, shape, op, root) in the same order")
RULE_PAIRED = ("NCCL runs a rank's unbatched transfers with one peer one after the other and matches sends to "
               "receives by posting order, so two ranks that both send (or both receive) first wait for each "
               "other and hang once the messages outgrow its buffers (NVIDIA/nccl#479); post each rank's send "
               "and receive as one torch.distributed.batch_isend_irecv (polytrain.distributed.collectives.exchange)")
RULE_TAGS = ("NCCL ignores point-to-point tags and matches transfers by posting order only; use tag 0 and "
             "post sends and receives in the same order on both peers")
RULE_IN_FLIGHT = ("a GPU collective library reads and writes the tensors of an asynchronous operation on its "
                  "own stream until it completes, so a change before wait() races with the transfer; "
                  "change them only after wait()")


class StrictCollectiveError(PolytrainError, RuntimeError):
    """Code that a GPU collective library would hang on or corrupt (POLYTRAIN_STRICT_COLLECTIVES)."""


def enabled() -> bool:
    """Whether POLYTRAIN_STRICT_COLLECTIVES asks for the checks."""
    return os.environ.get(ENV, "0") not in ("", "0")


@dataclass
class _Issued:
    """An asynchronous operation until its wait(): its tensors' versions, and what to verify then."""

    what: str
    tensors: list[tuple[torch.Tensor, int]]
    verify: Callable[[], None] | None = None


@dataclass
class _Posts:
    """One channel's numbered posts (a group's collectives, or the transfers with one peer): the
    next number, this rank's posts not yet compared, and the other side's popped ahead of need."""

    next: int = 0
    mine: dict[int, str] = field(default_factory=dict)
    theirs: dict[int, str] = field(default_factory=dict)


class _Checker:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        """Forget the world's calls (its process group was destroyed; a new one numbers afresh)."""
        self.inside = threading.local()  # depth of wrapped calls: those a wrapped call makes are its own
        self.channels: dict[str, _Posts] = {}
        self.issued: dict[int, tuple[Any, _Issued]] = {}  # id(work) -> (work, what it carries)
        self._store = None

    # ----- posts through the store's queues ------------------------------------------------------

    def store(self):
        if self._store is None:
            self._store = dist.PrefixStore("polytrain-strict-collectives", c10d._get_default_store())
        return self._store

    def post(self, channel: str, queue: str, value: str) -> int:
        """Number `value` on `channel` and push it to `queue` (which one other rank pops)."""
        with self.lock:
            posts = self.channels.setdefault(channel, _Posts())
            number = posts.next
            posts.next += 1
            posts.mine[number] = value
            self.store().queue_push(queue, f"{number}|{value}")
        return number

    def compare(self, channel: str, queue: str, number: int,
                patience: float | None = None) -> tuple[str, str] | None:
        """(this rank's post `number`, the other side's) from `queue`, waiting for it to be
        pushed (at most `patience` seconds, if given: then None); None where it was compared already."""
        with self.lock:
            posts = self.channels[channel]
            if number not in posts.mine:
                return None
            while number not in posts.theirs:
                value = self._pop(queue, patience)
                if value is None:
                    return None
                theirs, value = value.split("|", 1)
                posts.theirs[int(theirs)] = value
            return posts.mine.pop(number), posts.theirs.pop(number)

    def _pop(self, queue: str, patience: float | None) -> str | None:
        """The oldest post of `queue`, polling while it is empty (the store's blocking pop returns
        at once on a queue that existed before); None after `patience` seconds."""
        store, nap = self.store(), 0.0002
        deadline = time.monotonic() + (patience if patience is not None else store.timeout.total_seconds())
        while True:
            try:
                return store.queue_pop(queue, block=False).decode()
            except dist.QueueEmptyError:
                if time.monotonic() > deadline:
                    if patience is not None:
                        return None
                    raise StrictCollectiveError(f"strict collectives: rank {dist.get_rank()} waited "
                                                f"{store.timeout} for a peer's post to {queue}") from None
                time.sleep(nap)
                nap = min(2 * nap, 0.02)

    # ----- collectives: each rank compares with the next rank of the group ----------------------

    def post_collective(self, group, fingerprint: str) -> int:
        name, me = group.group_name, dist.get_rank(group)
        return self.post(f"c/{name}", f"c/{name}/{me}", fingerprint)

    def verify_collectives(self, group, upto: int, patience: float | None = None) -> bool:
        """Compare this rank's collectives on `group` numbered <= upto with the next rank's; False
        where the next rank has not posted them within `patience` seconds (compared later)."""
        name, size = group.group_name, dist.get_world_size(group)
        nxt = (dist.get_rank(group) + 1) % size
        with self.lock:
            numbers = sorted(n for n in self.channels[f"c/{name}"].mine if n <= upto)
        for number in numbers:
            with self.lock:
                if self.channels[f"c/{name}"].mine.get(number) is None:
                    continue
                pair = self.compare(f"c/{name}", f"c/{name}/{nxt}", number, patience)
                if pair is None:
                    return False
            if pair[0] != pair[1]:
                ranks = dist.get_process_group_ranks(group)
                raise StrictCollectiveError(
                    f"strict collectives: rank {dist.get_rank()}'s collective #{number} on group {name} "
                    f"(global ranks {ranks}) is {pair[0]}, but global rank {ranks[nxt]}'s is {pair[1]}: "
                    f"{RULE_ORDER} ({ENV}=1)")
        return True

    # ----- transfers: each rank compares its k-th with a peer with the peer's k-th with it -------

    def post_transfer(self, peer: int, direction: str, batched: bool) -> int:
        me = dist.get_rank()
        return self.post(f"p/{peer}", f"p/{me}->{peer}", f"{direction}{' batched' if batched else ''}")

    def verify_transfer(self, peer: int, number: int, what: str) -> None:
        pair = self.compare(f"p/{peer}", f"p/{peer}->{dist.get_rank()}", number)
        if pair is not None and pair[0] == pair[1] and "batched" not in pair[0]:
            raise StrictCollectiveError(
                f"strict collectives: rank {dist.get_rank()}'s unbatched {what} is its transfer #{number} with rank "
                f"{peer}, and rank {peer}'s transfer #{number} with it is an unbatched {pair[1]} too: {RULE_PAIRED} "
                f"({ENV}=1)")

    # ----- the wrappers -----------------------------------------------------------------------

    def wrap(self, name: str, fn: Callable) -> Callable:
        signature = inspect.signature(fn)
        checked = self.collective if name in COLLECTIVES else self.batch if name == "batch_isend_irecv" \
            else self.point_to_point

        def strict(*args: Any, **kwargs: Any) -> Any:
            if getattr(self.inside, "depth", 0) or not dist.is_initialized():
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self.inside.depth = 1
            try:
                return checked(name, fn, bound)
            finally:
                self.inside.depth = 0

        strict.__wrapped__ = fn
        strict.__name__ = strict.__qualname__ = fn.__name__
        strict.__doc__ = fn.__doc__
        return strict

    def collective(self, name: str, fn: Callable, bound: inspect.BoundArguments) -> Any:
        group = bound.arguments.get("group") or c10d._get_default_group()
        if dist.get_rank(group) < 0 or dist.get_world_size(group) == 1:
            return fn(*bound.args, **bound.kwargs)
        number = self.post_collective(group, _fingerprint(name, bound.arguments))
        asynchronous = bool(bound.arguments.get("async_op"))
        # Before a blocking call, so a mismatch is named rather than hung on; a rank whose next
        # peer is late (a hang, a slow rank) enters the call anyway and compares after it.
        compared = asynchronous or self.verify_collectives(group, number, patience=PATIENCE_S)
        result = fn(*bound.args, **bound.kwargs)
        if not compared:
            self.verify_collectives(group, number)
        if asynchronous and result is not None:
            read = {k: v for k, v in bound.arguments.items() if k not in OUTPUTS}
            self.track(result, _Issued(f"{name} #{number} on group {group.group_name}", _tensors(read),
                                       lambda: self.verify_collectives(group, number)))
        return result

    def point_to_point(self, name: str, fn: Callable, bound: inspect.BoundArguments) -> Any:
        args = bound.arguments
        direction = "send" if name in SENDS else "recv"
        group = args.get("group") or c10d._get_default_group()
        peer_arg = args.get("dst" if direction == "send" else "src")
        group_peer = args.get("group_dst" if direction == "send" else "group_src")
        if peer_arg is None and group_peer is None:  # a receive from any rank: no pair to number
            return fn(*bound.args, **bound.kwargs)
        peer = peer_arg if peer_arg is not None else dist.get_global_rank(group, group_peer)
        what = f"{name} {'to' if direction == 'send' else 'from'} rank {peer}"
        if args.get("tag", 0):
            raise StrictCollectiveError(
                f"strict collectives: rank {dist.get_rank()}'s {what} has tag {args['tag']}: {RULE_TAGS} ({ENV}=1)")
        number = self.post_transfer(peer, direction, batched=False)
        result = fn(*bound.args, **bound.kwargs)
        if name in SENDS[1:] + RECEIVES[1:] and result is not None:  # isend / irecv: at wait()
            self.track(result, _Issued(what, _tensors(args), lambda: self.verify_transfer(peer, number, what)))
        else:
            self.verify_transfer(peer, number, what)
        return result

    def batch(self, name: str, fn: Callable, bound: inspect.BoundArguments) -> Any:
        ops = bound.arguments["p2p_op_list"]
        me = dist.get_rank()
        for op in ops:
            if op.tag:
                raise StrictCollectiveError(f"strict collectives: rank {me}'s batched {op.op.__name__} with rank "
                                            f"{op.peer} has tag {op.tag}: {RULE_TAGS} ({ENV}=1)")
        numbers = [self.post_transfer(op.peer, "send" if "send" in op.op.__name__ else "recv", batched=True)
                   for op in ops]
        works = fn(*bound.args, **bound.kwargs)

        def verify(indices: range) -> Callable[[], None]:
            return lambda: [self.verify_transfer(ops[i].peer, numbers[i], "") for i in indices]

        if len(works) == len(ops):  # one work per transfer (backends without coalescing)
            for i, (work, op) in enumerate(zip(works, ops)):
                self.track(work, _Issued(f"batched {op.op.__name__} with rank {op.peer}", _tensors({"t": op.tensor}),
                                         verify(range(i, i + 1))))
        else:  # one work for the whole batch
            what = ", ".join(f"batched {op.op.__name__} with rank {op.peer}" for op in ops)
            for work in works:
                self.track(work, _Issued(what, _tensors({"t": [op.tensor for op in ops]}), verify(range(len(ops)))))
        return works

    def host(self, name: str, fn: Callable) -> Callable:
        """A shared-memory collective: checked like the process group's; the ones it makes itself
        (its group's channel set-up) are its own."""

        def strict(out: torch.Tensor, *rest: Any) -> Any:
            group = rest[-1] if rest else None
            group = group or c10d._get_default_group()
            if getattr(self.inside, "depth", 0) or not dist.is_initialized() or dist.get_world_size(group) == 1 \
                    or not host_collectives.may_share(out):  # the process group's call follows, checked
                return fn(out, *rest)
            tensors = {"out": out, "x": rest[0]} if len(rest) == 2 else {"x": out}
            number = self.post_collective(group, _fingerprint(f"host_{name}", tensors, list(tensors)))
            compared = self.verify_collectives(group, number, patience=PATIENCE_S)
            self.inside.depth = 1
            try:
                result = fn(out, *rest)
            finally:
                self.inside.depth = 0
            if not compared:
                self.verify_collectives(group, number)
            return result

        strict.__wrapped__ = fn
        strict.__name__ = strict.__qualname__ = name
        strict.__doc__ = fn.__doc__
        return strict

    # ----- asynchronous work --------------------------------------------------------------------

    def track(self, work: Any, issued: _Issued) -> None:
        with self.lock:
            self.issued[id(work)] = (work, issued)

    def waited(self, work: Any) -> None:
        with self.lock:
            entry = self.issued.pop(id(work), None)
        if entry is None or entry[0] is not work:
            return
        issued = entry[1]
        changed = [(t, v) for t, v in issued.tensors if t._version != v]
        if changed:
            t, v = changed[0]
            raise StrictCollectiveError(
                f"strict collectives: rank {dist.get_rank()} changed a {_describe(t)} tensor of its {issued.what} "
                f"while the operation was in flight (version {v} at issue, {t._version} at wait()): "
                f"{RULE_IN_FLIGHT} ({ENV}=1)")
        if issued.verify is not None:
            issued.verify()


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in x) + "]"
    return str(getattr(x, "name", x))


def _fingerprint(name: str, arguments: dict[str, Any], agreed: list[str] | None = None) -> str:
    """`name(arg=value, ...)` over the arguments every rank of the group must pass alike."""
    keys = COLLECTIVES.get(name, ()) if agreed is None else agreed
    if name == "all_to_all_single" and (arguments.get("output_split_sizes") is not None
                                        or arguments.get("input_split_sizes") is not None):
        keys = ()
    if name.startswith("all_to_all") and not keys:  # sizes may differ per pair: dtypes only
        dtypes = {str(t.dtype).removeprefix("torch.") for t, _ in _tensors(arguments)}
        return f"{name}({', '.join(sorted(dtypes))})"
    return f"{name}(" + ", ".join(f"{k}={_describe(arguments[k])}" for k in keys
                                  if arguments.get(k) is not None) + ")"


def _tensors(arguments: dict[str, Any]) -> list[tuple[torch.Tensor, int]]:
    """Every tensor among `arguments` (lists included) with its version now."""
    found = []
    for value in arguments.values():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, torch.Tensor):
                found.append((v, v._version))
    return found


_checker: _Checker | None = None


def install() -> bool:
    """Wrap torch.distributed's collectives and transfers, the shared-memory collectives and
    Work.wait with the checks (once per process); returns whether they are on. Call it before
    any P2POp is made: torch compares a P2POp's function with its own isend/irecv."""
    global _checker
    if _checker is not None:
        return True
    checker = _Checker()
    for name in (*COLLECTIVES, *SENDS, *RECEIVES, "batch_isend_irecv"):
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapped = checker.wrap(name, original)
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                setattr(module, name, wrapped)
    for name in HOST:
        setattr(host_collectives, name, checker.host(name, getattr(host_collectives, name)))
    real_wait = dist.Work.wait

    def wait(work, *args: Any, **kwargs: Any) -> Any:
        checker.waited(work)  # first: a mismatched call could hang the real wait
        return real_wait(work, *args, **kwargs)

    dist.Work.wait = wait
    real_destroy = c10d.destroy_process_group

    def destroy_process_group(group=None) -> None:
        real_destroy(group)
        if group is None:  # a new world numbers its groups and calls afresh
            checker.reset()

    for module in (c10d, dist):
        module.destroy_process_group = destroy_process_group
    _checker = checker
    return True


def install_if_enabled() -> bool:
    """`install()` where POLYTRAIN_STRICT_COLLECTIVES is set; whether the checks are on."""
    return install() if enabled() else _checker is not None
