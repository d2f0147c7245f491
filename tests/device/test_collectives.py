"""The tier accelerator's collective library gives gloo's results, on device tensors."""

from __future__ import annotations

import pytest

from tests.multirank import run_ranks

pytestmark = pytest.mark.slow


def _collectives(rank: int, world_size: int) -> dict[str, list]:
    """Each collective on device tensors, its result brought to the host as lists."""
    import torch
    import torch.distributed as dist

    from polytrain.backend import get_accelerator

    device = get_accelerator().device(rank)
    base = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank  # (4,)
    out: dict[str, list] = {}
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("max", dist.ReduceOp.MAX)):
        t = base.clone()
        dist.all_reduce(t, op=op)
        out[f"all_reduce_{name}"] = t.tolist()
        piece = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(piece, base.clone(), op=op)
        out[f"reduce_scatter_{name}"] = piece.tolist()
    gathered = torch.empty(4 * world_size, device=device)
    dist.all_gather_into_tensor(gathered, base)
    out["all_gather_into_tensor"] = gathered.tolist()
    parts = [torch.empty(4, device=device) for _ in range(world_size)]
    dist.all_gather(parts, base)
    out["all_gather"] = [p.tolist() for p in parts]
    swapped = torch.empty(4, device=device)
    dist.all_to_all_single(swapped, base)
    out["all_to_all_single"] = swapped.tolist()
    sent = base.clone()
    dist.broadcast(sent, src=1)
    out["broadcast"] = sent.tolist()
    # p2p, batched as polytrain posts it (collectives.exchange): both list the receive first; a
    # library whose receive returned only once done would deadlock here
    received = torch.zeros(4, device=device)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, 1 - rank),
                                        dist.P2POp(dist.isend, base, 1 - rank)]):
        work.wait()
    out["isend_irecv"] = received.tolist()
    try:
        dist.all_reduce(torch.ones(2))  # a host tensor: NCCL refuses it, so must this library
        out["host_tensor"] = ["accepted"]
    except (RuntimeError, ValueError) as e:
        out["host_tensor"] = [str(e).splitlines()[0]]
    return out


def test_collectives_give_gloos_results_on_device_tensors(on_tier):
    got = run_ranks(2, _collectives)
    r0, r1 = [0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]
    for rank in (0, 1):
        mine = (r0, r1)[rank]
        assert got[rank]["all_reduce_sum"] == [10.0, 12.0, 14.0, 16.0]
        assert got[rank]["all_reduce_avg"] == [5.0, 6.0, 7.0, 8.0]
        assert got[rank]["all_reduce_max"] == r1
        assert got[rank]["reduce_scatter_sum"] == [[10.0, 12.0], [14.0, 16.0]][rank]
        assert got[rank]["reduce_scatter_avg"] == [[5.0, 6.0], [7.0, 8.0]][rank]
        assert got[rank]["all_gather_into_tensor"] == r0 + r1
        assert got[rank]["all_gather"] == [r0, r1]
        assert got[rank]["broadcast"] == r1
        assert got[rank]["isend_irecv"] == (r1, r0)[rank]
    assert got[0]["all_to_all_single"] == [0.0, 1.0, 10.0, 11.0]
    assert got[1]["all_to_all_single"] == [2.0, 3.0, 12.0, 13.0]
    assert "accepted" not in got[0]["host_tensor"][0], "a host tensor went through the device's collectives"
