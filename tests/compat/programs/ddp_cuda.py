"""A DDP training step written for CUDA and NCCL, as torchrun users write it."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    assert torch.cuda.is_available() and torch.cuda.device_count() >= dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 8).cuda(), device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, device=f"cuda:{local_rank}") * (dist.get_rank() + 1)
    model(x).pow(2).mean().backward()
    optimizer.step()
    total = torch.ones(1).cuda() * (dist.get_rank() + 1)
    dist.all_reduce(total, group=dist.new_group(backend="nccl"))
    dist.barrier(device_ids=[local_rank])
    checksum = sum(p.sum().item() for p in model.parameters())
    print(f"rank {dist.get_rank()} device {torch.cuda.current_device()} sum {total.item():.0f} "
          f"params {checksum:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
