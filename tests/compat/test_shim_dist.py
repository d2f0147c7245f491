"""NCCL, DDP, FSDP and DeviceMesh as CUDA code uses them, on gloo (one rank, in this process;
test_run.py runs two)."""

import socket

import pytest
import torch
import torch.distributed as dist

from polytrain.backend import CPUAccelerator
from polytrain.backend.compat.devices import DeviceMap
from polytrain.backend.compat.dist import map_backend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("asked, expected", [
    ("nccl", "gloo"), ("NCCL", "gloo"), ("gloo", "gloo"), ("cuda:nccl", "cpu:gloo"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo"), (None, None),
])
def test_backend_strings(asked, expected):
    assert map_backend(asked, DeviceMap(CPUAccelerator())) == expected


@pytest.fixture
def group(shim):
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_nccl_groups_barriers_and_ddp_run_on_gloo(group):
    assert dist.get_backend() == "gloo"  # the truth: torch decides buffer placement from it
    assert dist.is_nccl_available()
    sub = dist.new_group(ranks=[0], backend="nccl")
    t = torch.ones(2, device="cuda")
    dist.all_reduce(t, group=sub)
    dist.barrier(device_ids=[torch.cuda.current_device()])
    objects = [None]
    dist.broadcast_object_list(objects, src=0, device=torch.device("cuda"))
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(4, 4).cuda(), device_ids=[0], output_device=0)
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    assert model.module.weight.grad is not None


def test_device_mesh_and_fsdp_take_cuda_arguments(group):
    mesh = dist.init_device_mesh("cuda", (1,))
    assert mesh.device_type == "cpu"
    from torch.distributed.fsdp import FullyShardedDataParallel  # patched when imported

    for device_id in (torch.cuda.current_device(), None):
        model = FullyShardedDataParallel(torch.nn.Linear(4, 4).cuda(), device_id=device_id)
        model(torch.randn(2, 4, device="cuda")).sum().backward()
        assert all(p.grad is not None for p in model.parameters())


def test_nccls_premul_sum_runs_as_scale_then_sum(group):
    # FSDP2 reduce-scatters with PREMUL_SUM once a gradient divide factor is set (torchtitan).
    op = dist.ReduceOp.PREMUL_SUM(0.25)
    t = torch.full((4,), 2.0, device="cuda")
    dist.all_reduce(t, op=op)
    assert torch.equal(t, torch.full((4,), 0.5))
    source, out = torch.arange(4.0), torch.empty(4)
    dist.reduce_scatter_tensor(out, source, op=op)
    assert torch.equal(out, torch.arange(4.0) / 4) and torch.equal(source, torch.arange(4.0))
