"""The shared-memory all-reduce, reduce-scatter, all-gather and all-to-all give what gloo's give, on every rank alike, and name who is late."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from polytrain.backend import host_collectives
from tests.multirank import run_ranks

pytestmark = pytest.mark.skipif(not host_collectives._X86, reason="the shared-memory path is x86-64 only")


def _same_on_every_rank(x: torch.Tensor, group) -> bool:
    import torch.distributed as dist

    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, x, group=group)
    return all(torch.equal(g, x) for g in gathered)


def _compiled_graph_shares(group, members: int, generator: torch.Generator) -> None:
    """A compiled graph's collectives (host_collective_ops.py) give eager's bits, through the
    shared buffer: one exchange each, with no graph break."""
    import torch.distributed as dist

    from polytrain.distributed import collectives

    def four(x):  # x (members * 2, 3)
        gathered = collectives.all_gather(x, 0, group)  # (members^2 * 2, 3)
        return (collectives.all_reduce(x, group), gathered, collectives.reduce_scatter(gathered, 0, group),
                collectives.all_to_all(x.view(members, -1), group))

    x = torch.randn(members * 2, 3, generator=generator)
    eager = four(x)
    channel = host_collectives._channels[group if group is not None else dist.group.WORLD]
    before = channel.calls
    compiled = torch.compile(four, backend="aot_eager", fullgraph=True)(x)
    assert channel.calls - before == 4
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


def _check(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from polytrain.distributed.collectives import all_reduce, start_all_reduce

    pair = dist.new_group([0, 1])
    abandoned = dist.new_group([0, 1])
    generator = torch.Generator().manual_seed(rank)
    # (numel, dtype): one slot piece, several pieces (> SLOT_BYTES), 16-bit, an odd size.
    cases = [(2048 * 384, torch.float32), (3 * host_collectives.SLOT_BYTES // 8, torch.float32),
             (2048 * 384, torch.bfloat16), (1001, torch.float32)]
    for group, members in ((None, world_size), (pair, 2)):
        if rank >= members:
            continue
        for _ in range(3):  # both buffer sets, reused
            for numel, dtype in cases:
                x = torch.randn(numel, generator=generator).to(dtype)
                sent, reference = x.clone(), x.clone()
                dist.all_reduce(reference, group=group)  # gloo's own
                ours = all_reduce(x, group)
                started, work = start_all_reduce(x, group)
                assert work is None  # done at once
                assert torch.equal(ours, started) and _same_on_every_rank(ours, group)
                assert torch.equal(x, sent)  # the input is left alone
                assert host_collectives.all_reduce_(sent, group) and torch.equal(sent, ours)  # in place: same bits
                if members == 2:  # a + b in either order: the same bits
                    assert torch.equal(ours, reference)
                else:  # against the float64 sum, to within two roundings in the dtype
                    every = [torch.empty_like(x) for _ in range(members)]
                    dist.all_gather(every, x, group=group)
                    summed = torch.stack(every).double()  # (members, numel)
                    bound = 2 * torch.finfo(dtype).eps * summed.abs().sum(0)
                    assert ((ours.double() - summed.sum(0)).abs() <= bound).all()
            for numel, dtype in cases:  # all-gather: exactly gloo's
                x = torch.randn(numel, generator=generator).to(dtype)
                reference = x.new_empty(members * numel)
                dist.all_gather_single(reference, x, group=group)
                ours = torch.full_like(reference, float("nan"))
                assert host_collectives.all_gather_(ours, x, group)
                assert torch.equal(ours, reference)
            for numel, dtype in cases:  # all-to-all: exactly gloo's
                x = torch.randn(members, numel, generator=generator).to(dtype)  # row j for rank j
                reference = torch.empty_like(x)
                dist.all_to_all_single(reference, x, group=group)
                ours = torch.full_like(x, float("nan"))
                assert host_collectives.all_to_all_(ours, x, group)
                assert torch.equal(ours, reference)
            for numel, dtype in cases:  # reduce-scatter: the all-reduce's row, bit for bit
                x = torch.randn(members * numel, generator=generator).to(dtype)  # (n * S,)
                row = all_reduce(x, group).view(members, numel)[dist.get_rank(group)]
                ours = torch.full_like(row, float("nan"))
                assert host_collectives.reduce_scatter_(ours, x, group)
                assert torch.equal(ours, row)
                in_place = x.clone()  # out aliasing its own row of x, as ZeRO's buckets do
                mine = in_place.view(members, numel)[dist.get_rank(group)]
                assert host_collectives.reduce_scatter_(mine, in_place, group) and torch.equal(mine, row)
                if members == 2:
                    reference = x.new_empty(numel)
                    dist.reduce_scatter_single(reference, x.clone(), group=group)
                    assert torch.equal(ours, reference)
        columns = torch.randn(33, 64, generator=generator).t()  # not contiguous: summed from a copy
        reference = columns.contiguous()
        dist.all_reduce(reference, group=group)
        assert torch.equal(all_reduce(columns, group), reference) or members > 2
        key = group if group is not None else dist.group.WORLD
        assert host_collectives._channels[key].calls >= 10 * len(cases)  # it went through shared memory
        _compiled_graph_shares(group, members, generator)
    ints = torch.arange(6) * (rank + 1)
    assert torch.equal(all_reduce(ints, None), torch.arange(6) * sum(range(1, world_size + 1)))  # gloo's
    assert not glob.glob(os.path.join(host_collectives._shm_dir(), "polytrain-collectives-*"))  # unlinked
    os.environ[host_collectives.ENV_SWITCH] = "0"
    assert not host_collectives.usable(torch.ones(3), None)
    del os.environ[host_collectives.ENV_SWITCH]
    dist.barrier()
    if rank < 2:  # opens the channel on ranks 0 and 1, sums nothing
        host_collectives.all_reduce_(torch.ones(0), abandoned)
    if rank == 0:  # rank 1 never joins these calls
        channel = host_collectives._channels[abandoned]
        live_pid, channel.pids[1] = channel.pids[1], _exited_pid()
        with pytest.raises(RuntimeError, match=rf"rank\(s\) 1 \(pid {channel.pids[1]}\) exited"):
            host_collectives.all_reduce_(torch.ones(4), abandoned)
        channel.pids[1] = live_pid
        host_collectives.WAIT_TIMEOUT_S = 0.5
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not arrive"):
            host_collectives.all_reduce_(torch.ones(4), abandoned)
    dist.barrier()  # rank 1 lives (and waits in gloo) until rank 0 is done


def _exited_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    import subprocess
    import sys

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def test_a_zombie_is_not_alive():
    import subprocess
    import sys
    import time

    assert host_collectives._alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while host_collectives._alive(child.pid) and time.monotonic() < deadline:  # exited, not yet reaped
        time.sleep(0.01)
    assert not host_collectives._alive(child.pid)
    child.wait()
    assert not host_collectives._alive(child.pid)


def test_waiting_ranks_poll_only_where_every_rank_has_its_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert not host_collectives.oversubscribed(2, 1)  # tp 2 on 2 cores: poll
    assert host_collectives.oversubscribed(4, 1)  # tp 2 x pp 2 on 2 cores: nap at once
    assert host_collectives.oversubscribed(2, 2)
    monkeypatch.setenv(host_collectives.POLLS_SWITCH, "7")
    assert host_collectives._polls_setting() == 7
    monkeypatch.setenv(host_collectives.POLLS_SWITCH, "many")
    with pytest.raises(ValueError, match="POLYTRAIN_SHM_POLLS='many'"):
        host_collectives._polls_setting()
    monkeypatch.delenv(host_collectives.POLLS_SWITCH)
    assert host_collectives._polls_setting() is None


def test_shared_memory_collectives_match_gloo():
    run_ranks(3, _check)
