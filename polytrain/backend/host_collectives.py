"""All-reduce, reduce-scatter, all-gather and all-to-all through shared memory, between the
ranks of one host.

Tensor parallelism all-reduces activations several times per layer; ZeRO reduces gradient
buckets and gathers parameters every step. Between processes of one machine, gloo moves
every byte over TCP loopback, with its own threads doing the copies: a (2048, 384) fp32 sum
between 2 ranks takes 3.9 ms (median) on this project's 2-core machine, where writing it to
shared memory, waiting for the peer's flag and adding the peer's copy takes about 1 ms. Each group gets one mapped buffer (2 sets x n ranks x
`SLOT_BYTES`) and an int64 flag per rank:

    call g:  rank r copies its tensor into set g % 2, slot r; writes flag[r] = g
             waits until every flag >= g
             sums slots 0..n-1 of set g % 2 in rank order (every rank gets identical bits)

A reduce-scatter publishes all n rows the same way and rank r sums only row r of the slots;
an all-gather publishes its shard and every rank copies the n slots out in rank order; an
all-to-all publishes all n rows and rank r copies out row r of every slot.
Alternating the two sets needs no second wait: a rank writes set g % 2 again at call g + 2,
only after every peer's flag reached g + 1, which each set after it finished reading call g.
Tensors larger than a slot go through in slot-sized pieces (ZeRO's 25 MiB buckets, FSDP2's
gathered blocks).

Used when every rank of the group runs on this host (checked once per group), the tensor is
a contiguous host tensor of a floating dtype (an all-reduce: summed), and the machine is
x86-64: the flag protocol relies on its store order (a store is seen by others after the
stores before it), which ARM does not promise without fences Python cannot issue. Compiled
graphs reach it through the operators of host_collective_ops.py. Elsewhere, or with
POLYTRAIN_SHM_ALL_REDUCE=0 (every collective here), the process group's own run.
The shared path is synchronous: where the caller would have overlapped an asynchronous gloo
call with backward (ZeRO-1/2's buckets, tp's input gradients), it gets the result at once,
and the work a gloo call would have taken from the cores is gone.
The mapping's file is unlinked as soon as every rank holds it, so nothing is left in
/dev/shm when a job dies; a rank waiting for a peer whose process has exited raises within
LIVENESS_CHECK_S, naming it, as gloo's broken connection would.
"""

from __future__ import annotations

import os
import platform
import socket
import tempfile
import time
import uuid
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from polytrain.backend import futex

SLOT_BYTES = 4 * 1024 * 1024
"""One rank's part of one buffer set: a (2048, 512) fp32 tensor in one piece."""
WAIT_TIMEOUT_S = 600.0
"""How long a rank waits for its live peers' flags before it says which one did not arrive."""
LIVENESS_CHECK_S = 0.2
"""How often a waiting rank looks whether its late peers' processes still exist."""
FAST_POLLS = 2000
"""Flag polls (about 1 us each) before a waiting rank starts to sleep, where every rank of the
host has its own cores; where they outnumber the cores, a waiting rank sleeps at once.
POLYTRAIN_SHM_POLLS=N sets the count for every host (0: always sleep). It sleeps on the late
peer's flag as a futex (backend/futex.py), woken by the peer the moment it writes it."""
POLLS_SWITCH = "POLYTRAIN_SHM_POLLS"
MIN_NAP_S, MAX_NAP_S = 50e-6, 500e-6
"""Without futexes (not x86-64 Linux): the first and the longest timed nap between polls."""
ENV_SWITCH = "POLYTRAIN_SHM_ALL_REDUCE"
_X86 = platform.machine().lower() in ("x86_64", "amd64")

# Per process group (the default one resolved, so a re-initialised world gets a new channel);
# a destroyed group's channel goes with it.
_channels: weakref.WeakKeyDictionary[ProcessGroup, _Channel | None] = weakref.WeakKeyDictionary()


class _Channel:
    """One process group's mapped buffer and flags (see the module doc)."""

    def __init__(self, group: ProcessGroup | None, path: str, pids: list[int]):
        self.rank, self.size, self.pids = dist.get_rank(group), dist.get_world_size(group), pids
        data_bytes = 2 * self.size * SLOT_BYTES
        mapped = torch.from_file(path, shared=True, size=data_bytes + 8 * self.size, dtype=torch.uint8)
        self.data = mapped[:data_bytes].view(2, self.size, SLOT_BYTES)  # (set, rank, bytes)
        self.flags = mapped[data_bytes:].view(torch.int64)  # (rank,)
        self.calls = 0
        self.peers = dist.get_process_group_ranks(group) if group is not None else list(range(self.size))
        local_ranks = max(self.size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.fast_polls = _polls_setting()
        if self.fast_polls is None:
            self.fast_polls = 0 if oversubscribed(local_ranks, torch.get_num_threads()) else FAST_POLLS

    def all_reduce(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Sum contiguous `x` over the group into contiguous `out` of its shape (`x` itself: in place).

        A piece of `x` is published before its part of `out` is written, and no later piece reads it."""
        step = SLOT_BYTES // x.element_size()
        pieces = _split(x.view(-1), step)
        for target, slots in zip(_split(out.view(-1), step), self._exchange(pieces)):
            self._sum(slots, target)

    def reduce_scatter_(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """This rank's row of the sum of every rank's contiguous `x` (n * S,) into `out` (S,).

        Each rank publishes all n rows but sums only its own: 1/n of an all-reduce's additions.
        `out` may be x's own row (ZeRO's buckets reduce in place): a piece's columns are all
        published before its part of `out` is written, and no later piece reads them."""
        start = 0
        for piece, slots in zip(*self._column_pieces(x.view(self.size, -1))):  # slots (ranks, n, w)
            self._sum(slots[:, self.rank], out[start:start + piece.shape[1]])
            start += piece.shape[1]

    def all_to_all_(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Row j of every rank's contiguous `x` (n, S) to rank j: out[i] (S,) = rank i's x[r]."""
        rows, received = x.view(self.size, -1), out.view(self.size, -1)  # (n, S) each
        start = 0
        for piece, slots in zip(*self._column_pieces(rows)):  # slots (ranks, n, w)
            received[:, start:start + piece.shape[1]].copy_(slots[:, self.rank])
            start += piece.shape[1]

    def all_gather_(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Every rank's contiguous `x` (S,) into `out` (n * S,), in group-rank order."""
        rows = out.view(self.size, -1)  # (n, S)
        pieces = _split(x.view(-1), SLOT_BYTES // x.element_size())
        start = 0
        for piece, slots in zip(pieces, self._exchange(pieces)):
            rows[:, start:start + piece.numel()].copy_(slots)
            start += piece.numel()

    def _column_pieces(self, rows: torch.Tensor) -> tuple[list[torch.Tensor], Iterator[torch.Tensor]]:
        """rows (n, S) in (n, w) column pieces of at most a slot's bytes, and their exchange."""
        width = max(1, SLOT_BYTES // (self.size * rows.element_size()))
        pieces = [rows[:, start:start + width] for start in range(0, rows.shape[1], width)]
        return pieces, self._exchange(pieces)

    def _sum(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """out = slots[0] + ... + slots[n - 1], added in rank order (the same bits on every rank)."""
        if self.size == 2:
            torch.add(slots[0], slots[1], out=out)
        else:
            torch.sum(slots, 0, out=out)

    def _exchange(self, pieces: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """For each piece (at most a slot's bytes): publish it, wait for every peer's, and yield
        every rank's copy, (n, *piece.shape), to be read before the next piece."""
        for piece in pieces:
            self.calls += 1
            nbytes = piece.numel() * piece.element_size()
            slots = self.data[self.calls % 2, :, :nbytes].view(piece.dtype).view(self.size, *piece.shape)
            slots[self.rank].copy_(piece)
            self.flags[self.rank] = self.calls
            if futex.AVAILABLE:
                futex.wake(self._flag_address(self.rank))  # peers asleep on this flag run at once
            self._wait_for_peers()
            yield slots

    def _wait_for_peers(self) -> None:
        """Poll the flags, yielding the core, while the peers are close behind; then sleep on a
        late peer's flag until it is written (a futex; elsewhere growing timed naps), and look
        every LIVENESS_CHECK_S whether a late peer's process still exists (gloo's TCP would fail
        at once when a peer dies; this says so too). Ranks that outnumber the cores (tests,
        tp x pp on a laptop) sleep from the first poll: a polling rank would take the core from
        the very peer it waits for (benchmarks/RESULTS.md, "Waiting ranks nap where they
        outnumber the cores": tp 2 x pp 2 on 2 cores ran 1.10x faster napping; tp 2 alone 1.01x
        faster polling; "Waiting ranks sleep on a futex": napping woke up to 500 us late,
        a futex at once)."""
        polls, nap, started, checked = 0, MIN_NAP_S / 2, None, 0.0
        while int(self.flags.min()) < self.calls:
            polls += 1
            if polls <= self.fast_polls:
                os.sched_yield()
                continue
            now = time.monotonic()
            if started is None:  # the first look at /proc after LIVENESS_CHECK_S: most waits end sooner
                started = checked = now
            if now - checked > LIVENESS_CHECK_S:
                checked = now
                late = [i for i, f in enumerate(self.flags.tolist()) if f < self.calls]
                dead = [f"{self.peers[i]} (pid {self.pids[i]})" for i in late if not _alive(self.pids[i])]
                if dead or now - started > WAIT_TIMEOUT_S:
                    what = f"rank(s) {', '.join(dead)} exited" if dead else (
                        f"rank(s) {[self.peers[i] for i in late]} did not arrive within {WAIT_TIMEOUT_S:.0f} s "
                        "(a peer hangs or runs other collectives)")
                    raise RuntimeError(f"shared-memory collective #{self.calls}: {what}; "
                                       f"{ENV_SWITCH}=0 uses the process group's own collectives")
            if futex.AVAILABLE:  # asleep until the late peer writes its flag (woken at once)
                peer = next((i for i, f in enumerate(self.flags.tolist()) if f < self.calls), None)
                if peer is not None:
                    futex.wait(self._flag_address(peer), int(self.flags[peer]), LIVENESS_CHECK_S)
                continue
            nap = min(MAX_NAP_S, nap * 2)
            time.sleep(nap)

    def _flag_address(self, rank: int) -> int:
        """Address of the low 32 bits of `rank`'s int64 flag (x86-64 is little-endian): the futex word."""
        return self.flags.data_ptr() + rank * self.flags.element_size()


def _polls_setting() -> int | None:
    """POLYTRAIN_SHM_POLLS as a count, None where it is not set."""
    value = os.environ.get(POLLS_SWITCH, "")
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{POLLS_SWITCH}={value!r}: give a count of flag polls (0: always sleep)")
    return int(value)


def oversubscribed(local_ranks: int, threads_per_rank: int) -> bool:
    """Whether this host's ranks, with their torch threads, want more cores than this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return local_ranks * threads_per_rank > cores


def _split(flat: torch.Tensor, step: int) -> list[torch.Tensor]:
    return [flat[start:start + step] for start in range(0, flat.numel(), step)]


def _alive(pid: int) -> bool:
    """Whether process `pid` on this host still runs (an exited, unreaped one does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # state after "(comm)"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _open(group: ProcessGroup | None) -> _Channel | None:
    """The group's channel, made collectively on its first use; None where it cannot be used:
    ranks on several hosts, or processes that do not share /dev/shm or see each other's pids
    (containers with one host name)."""
    size = dist.get_world_size(group)
    peers = [None] * size
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()), group=group)
    if len({host for host, _ in peers}) != 1:
        return None
    pids = [pid for _, pid in peers]
    name = [os.path.join(_shm_dir(), f"polytrain-collectives-{uuid.uuid4().hex}")]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if dist.get_rank(group) == 0:
        with open(name[0], "wb") as f:
            f.truncate(2 * size * SLOT_BYTES + 8 * size)  # zero flags: no call has happened
    dist.barrier(group=group)
    sees = [None] * size
    dist.all_gather_object(sees, os.path.exists(name[0]) and all(map(_alive, pids)), group=group)
    channel = _Channel(group, name[0], pids) if all(sees) else None
    dist.barrier(group=group)  # every rank has it mapped (or none will): the name can go
    if dist.get_rank(group) == 0:
        os.unlink(name[0])
    return channel


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def may_share(x: torch.Tensor) -> bool:
    """Whether a collective of `x` may go through shared memory at all: a floating host tensor
    on x86-64, the switch on (decided while tracing too: host_collective_ops.py)."""
    return (_X86 and x.device.type == "cpu" and x.is_floating_point()
            and os.environ.get(ENV_SWITCH, "1") != "0")


def usable(x: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Whether the shared path may take this call (the same answer on every rank of the group)."""
    return (may_share(x) and x.is_contiguous() and not torch.compiler.is_compiling()
            and dist.get_world_size(group) > 1)


def shared(group: ProcessGroup | None) -> bool:
    """Whether `group`'s floating host tensors go through shared memory (collective the first
    time a group is asked or used)."""
    return usable(torch.empty(1), group) and _channel(group) is not None


def all_reduce_(x: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Sum `x` over `group` in place through shared memory; False (nothing done) where this call
    or group cannot take the shared path (`usable`, ranks on several hosts): the caller then uses
    the process group. Collective: every rank of the group calls it."""
    return _run(_Channel.all_reduce, x, group, x, x)


def all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor | None:
    """The sum of `x` over `group` in a new contiguous tensor through shared memory (`x` is left
    alone, and not copied first as a clone for `all_reduce_` would be); None (nothing done) as
    `all_reduce_`. Collective."""
    source = x.contiguous()  # x itself where it is contiguous
    out = torch.empty_like(source)
    return out if _run(_Channel.all_reduce, source, group, out, source) else None


def all_gather_(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Gather every rank's `x` (S,) into contiguous `out` (n * S,) through shared memory; False
    (nothing done) as `all_reduce_`. Collective."""
    return _run(_Channel.all_gather_, x, group, out, x)


def reduce_scatter_(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Sum every rank's contiguous `x` (n * S,) and leave this rank's row r, x[r*S:(r+1)*S]
    summed, in `out` (S,), through shared memory; False (nothing done) as `all_reduce_`. Collective."""
    return _run(_Channel.reduce_scatter_, x, group, out, x)


def all_to_all_(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Rank r's out[i] = rank i's x[r], for contiguous x and out (n, ...) that do not overlap,
    through shared memory; False (nothing done) as `all_reduce_`. Collective."""
    return _run(_Channel.all_to_all_, x, group, out, x)


def _run(method, x: torch.Tensor, group: ProcessGroup | None, *args: torch.Tensor) -> bool:
    """`method(channel, *args)` on the group's channel where `x` may take the shared path."""
    channel = _channel(group) if usable(x, group) else None
    if channel is None:
        return False
    method(channel, *args)
    return True


def _channel(group: ProcessGroup | None) -> _Channel | None:
    key = group if group is not None else dist.group.WORLD
    if key not in _channels:
        _channels[key] = _open(group)
    return _channels[key]
