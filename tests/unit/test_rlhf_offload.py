"""rlhf.offload_reference / offload_reward: parked parameters come back bit for bit, views intact."""

from types import SimpleNamespace

import torch

from polytrain.backend import get_accelerator
from polytrain.rlhf.offload import IdleOffload, park, unpark


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    return model.requires_grad_(False)


def test_parked_storages_are_freed_and_come_back_identical():
    model = _model()
    x = torch.randn(3, 8)
    want = model(x)
    view = model[0].weight[1:3]  # a view, as a ZeRO-3 shard is of FSDP's flat buffer
    before = view.clone()
    parked = park(list(model.parameters()) + [model[0].weight])  # a storage met twice is parked once
    assert len(parked) == 4
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    unpark(parked)
    assert torch.equal(model(x), want) and torch.equal(view, before)


def test_idle_offload_runs_the_same_calls_where_the_device_is_the_host():
    model = _model()
    acc = get_accelerator()
    runtime = SimpleNamespace(acc=acc, device=acc.device())  # what IdleOffload reads of a Runtime
    idle = IdleOffload(model, runtime)
    assert idle.moves == 1 and idle.copies == (acc.device().type != "cpu")
    x = torch.randn(2, 8)
    want = model(x)
    for _ in range(2):
        with idle.resident():
            assert torch.equal(model(x), want)
    assert idle.moves == 3
