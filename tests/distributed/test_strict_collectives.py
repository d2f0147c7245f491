"""POLYTRAIN_STRICT_COLLECTIVES (polytrain/distributed/strict_collectives.py) on two gloo ranks:
each pattern NCCL forbids and gloo forgives is caught with an error naming the rule, and
correct code runs quiet. One launch runs every case; each test reads its case's outcome."""

from __future__ import annotations

import pytest

from tests.multirank import run_ranks


def _caught(fn) -> str | None:
    """The StrictCollectiveError message `fn` raised, or None where it raised none."""
    from polytrain.distributed.strict_collectives import StrictCollectiveError

    try:
        fn()
    except StrictCollectiveError as e:
        return str(e)
    return None


def _unbatched_send_and_receive(rank: int) -> list[str | None]:
    """Ring attention's rotation at ring size 2 as it was: isend to the peer, then irecv from it,
    on both ranks (gloo completes it; NCCL hangs once the messages outgrow its buffers)."""
    import torch
    import torch.distributed as dist

    peer = 1 - rank
    x, y = torch.full((1024,), float(rank)), torch.empty(1024)
    sent, received = dist.isend(x, peer), dist.irecv(y, peer)
    messages = [_caught(sent.wait), _caught(received.wait)]
    sent.wait()  # waited for real (no longer tracked)
    received.wait()
    assert y[0].item() == peer
    return messages


def _tagged_transfer(rank: int) -> list[str | None]:
    import torch
    import torch.distributed as dist

    x = torch.zeros(4)
    unbatched = _caught(lambda: dist.isend(x, 1 - rank, tag=1))
    batched = _caught(lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, 1 - rank, tag=7)]))
    return [unbatched, batched]


def _collectives_in_different_orders(rank: int) -> str | None:
    """Same shapes, so gloo would run both calls (with wrong results); NCCL would hang or mix them."""
    import torch
    import torch.distributed as dist

    x, y = torch.ones(8), torch.ones(8)
    first, second = (lambda: dist.all_reduce(x), lambda: dist.broadcast(y, src=0))[::1 if rank == 0 else -1]
    message = _caught(first)
    _caught(second)  # its number matches the other rank's second: mismatched again, not issued
    dist.all_reduce(x)  # and the group goes on in step
    return message


def _changed_in_flight(rank: int) -> list[str | None]:
    import torch
    import torch.distributed as dist

    from polytrain.distributed.collectives import exchange

    x = torch.ones(4)
    work = dist.all_reduce(x, async_op=True)
    x.mul_(2)
    reduced = _caught(work.wait)
    work.wait()  # waited for real (no longer tracked)
    send, got = torch.ones(4), torch.empty(4)
    batch = exchange(sends=[(send, 1 - rank)], recvs=[(got, 1 - rank)])
    send.add_(1)
    sent = _caught(batch.wait)
    batch.wait()
    return [reduced, sent]


def _correct_code(rank: int) -> bool:
    """Batched transfers with one peer both ways, waited asynchronous collectives, shared-memory
    collectives, objects and barriers: nothing to report."""
    import torch
    import torch.distributed as dist

    from polytrain.distributed import collectives, strict_collectives

    assert strict_collectives.enabled() and hasattr(dist.isend, "__wrapped__")  # the checks are on
    peer = 1 - rank
    for _ in range(3):
        outgoing = [torch.full((300_000,), float(rank)), torch.full((5,), float(rank))]
        incoming = [torch.empty(300_000), torch.empty(5)]
        collectives.exchange(sends=[(t, peer) for t in outgoing], recvs=[(t, peer) for t in incoming]).wait()
        assert incoming[0][0].item() == peer
    mine, theirs = torch.full((1024,), float(rank)), torch.empty(1024)
    post = [lambda: dist.isend(mine, peer), lambda: dist.irecv(theirs, peer)]
    for work in [p() for p in (post if rank == 0 else post[::-1])]:  # rank 0 sends first, rank 1 receives
        work.wait()
    assert theirs[0].item() == peer
    x = torch.ones(16)
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    x.add_(1)  # after wait(): fine
    # gloo's asynchronous all-gather and reduce-scatter write their outputs through ATen before
    # wait() (their versions move): only what they read is checked (ZeRO's parameter gathers)
    gathered, scattered = torch.empty(128), torch.empty(64)
    works = [dist.all_gather_into_tensor(gathered, torch.full((64,), float(rank)), async_op=True),
             dist.reduce_scatter_tensor(scattered, torch.ones(128), async_op=True)]
    for work in works:
        work.wait()
    assert gathered[64].item() == 1 and scattered[0].item() == 2
    collectives.all_reduce(torch.ones(64), None)
    collectives.all_gather(torch.ones(4, 2), 0, None)
    objects = [None, None]
    dist.all_gather_object(objects, rank)
    dist.barrier()
    return objects == [0, 1]


def _body(rank: int, world_size: int) -> dict:
    return {"paired": _unbatched_send_and_receive(rank), "tags": _tagged_transfer(rank),
            "order": _collectives_in_different_orders(rank), "in_flight": _changed_in_flight(rank),
            "quiet": _correct_code(rank)}


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(2, _body)


def test_unbatched_send_and_receive_with_one_peer_fail(outcomes):
    for rank, out in enumerate(outcomes):
        sent, received = out["paired"]
        assert sent is not None, f"rank {rank}: no error for an isend and irecv with one peer on both ranks"
        assert f"rank {rank}'s unbatched isend to rank {1 - rank} is its transfer #0 with rank {1 - rank}" in sent
        assert "is an unbatched send too" in sent and "batch_isend_irecv" in sent and "nccl#479" in sent
        assert received is not None and "unbatched irecv" in received and "unbatched recv too" in received


def test_tags_fail(outcomes):
    for out in outcomes:
        unbatched, batched = out["tags"]
        assert unbatched is not None and "has tag 1" in unbatched and "ignores point-to-point tags" in unbatched
        assert batched is not None and "has tag 7" in batched


def test_collectives_in_different_orders_fail(outcomes):
    for rank, out in enumerate(outcomes):
        message = out["order"]
        assert message is not None, f"rank {rank}: no error for collectives in different orders"
        mine, theirs = ("all_reduce", "broadcast") if rank == 0 else ("broadcast", "all_reduce")
        assert f"rank {rank}'s collective" in message and f"is {mine}(" in message
        assert f"global rank {1 - rank}'s is {theirs}(" in message and "same order" in message


def test_a_tensor_changed_in_flight_fails(outcomes):
    messages = [message for out in outcomes for message in out["in_flight"]]  # per rank: all_reduce, batch
    assert None not in messages, "a change in flight went unnoticed"
    assert all("while the operation was in flight (version 0 at issue, 1 at wait())" in m for m in messages)
    assert all("all_reduce #" in m for m in messages[0::2]) and all("batched isend" in m for m in messages[1::2])


def test_correct_code_passes(outcomes):
    assert [out["quiet"] for out in outcomes] == [True, True]
