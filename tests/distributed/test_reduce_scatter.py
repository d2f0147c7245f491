"""Every way of reducing gradients (shared memory, all-reduce, the process group's reduce-scatter)
leaves every rank the same sum of its row as torch's reduce-scatter."""

from __future__ import annotations

import torch

from tests.multirank import run_ranks


def _reduce(rank: int, world_size: int) -> None:
    import os

    import torch.distributed as dist

    from polytrain.backend import host_collectives
    from polytrain.distributed.reduce_scatter import HostReduceScatter, start_reduce_scatter

    group = dist.group.WORLD
    # (dp, S): row r is for rank r; values differ by rank so the sum is checkable.
    mine = torch.arange(world_size * 5, dtype=torch.float32).view(world_size, 5) * (rank + 1)
    expected = torch.arange(world_size * 5, dtype=torch.float32).view(world_size, 5)[rank]
    expected = expected * sum(r + 1 for r in range(world_size))
    reference = torch.empty(5)
    dist.reduce_scatter_single(reference, mine.clone().view(-1), group=group)
    assert torch.equal(reference, expected)
    for shared in ("1", "0"):  # through shared memory (x86-64 hosts), then the process group's
        os.environ[host_collectives.ENV_SWITCH] = shared
        for by_all_reduce in (False, True):
            send = mine.clone()
            work, recv = start_reduce_scatter(send, group, rank, by_all_reduce)
            if work is not None:  # None: summed at once through shared memory
                work.wait()
            assert torch.equal(recv, expected), (shared, by_all_reduce)
            assert (work is None) == (shared == "1" and host_collectives._X86)
        comm = HostReduceScatter()
        flat = comm.allocate((world_size * 5,), dtype=torch.float32, device=torch.device("cpu"))
        flat.copy_(mine.view(-1))
        out = comm.allocate((5,), dtype=torch.float32, device=torch.device("cpu"))
        assert comm(output_tensor=out, input_tensor=flat, group=group, op=dist.ReduceOp.SUM) is None
        assert torch.equal(out, expected), shared


def test_all_reduce_and_reduce_scatter_agree():
    run_ranks(3, _reduce)


def test_one_rank_reads_its_own_buffer():
    from polytrain.distributed.reduce_scatter import start_reduce_scatter

    send = torch.randn(1, 4)
    work, recv = start_reduce_scatter(send, None, 0, by_all_reduce=True)
    assert work is None and recv.data_ptr() == send.data_ptr()
