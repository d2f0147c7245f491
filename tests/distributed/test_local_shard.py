"""local_shard: a tp parameter's local tensor whose gradient equals to_local's (tensor_parallel/local_shard.py)."""

import torch

from tests.multirank import run_ranks


def _uses(weight, x, shard, tied: bool):
    """Two backward passes (micro-batches); `tied`: the second uses the weight twice (a tied table)."""
    (x @ shard(weight).t()).square().sum().backward()
    second = (x * 2) @ shard(weight).t() if tied else 0
    (x @ shard(weight).t() + second).tanh().sum().backward()


def _check(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from polytrain.distributed.tensor_parallel.local_shard import local_shard

    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(0)  # the same global tensors on both ranks
    for placement in (Shard(0), Replicate()):
        full = torch.randn(6, 5, generator=generator)
        x = torch.randn(4, 5, generator=generator) + rank  # each rank's own activations
        ours, theirs = (torch.nn.Parameter(distribute_tensor(full, mesh, [placement])) for _ in range(2))
        fired = []
        ours.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad._local_tensor.data_ptr()))
        for tied in (False, True):  # set to none between steps, as the trainer's zero_grad does
            ours.grad = theirs.grad = None
            fired.clear()
            _uses(ours, x, local_shard, tied)
            _uses(theirs, x, lambda p: p.to_local(), tied)
            assert isinstance(ours.grad, DTensor) and ours.grad._spec == theirs.grad._spec
            assert torch.allclose(ours.grad._local_tensor, theirs.grad._local_tensor, rtol=1e-6, atol=1e-6)
            assert len(fired) == 2  # ZeRO's hooks fire at every pass
            if not tied:  # accumulated in place, as autograd's own += (a tied pass sums its two uses anew)
                assert fired[0] == fired[1] == ours.grad._local_tensor.data_ptr()
        with torch.no_grad():  # no graph: a plain local tensor
            assert local_shard(ours).grad_fn is None and torch.equal(local_shard(ours), ours.to_local())


def test_local_shard_gives_to_locals_gradients_accumulated_in_place_with_hooks():
    run_ranks(2, _check)
