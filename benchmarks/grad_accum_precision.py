"""How precisely 16-bit gradients are summed over micro-batches (train.grad_accum_dtype).

    python benchmarks/grad_accum_precision.py                  # the table for 8 / 64 / 256 micro-batches, ~10 s
    python benchmarks/grad_accum_precision.py --micro-batches 8 1024

One bias-free Linear (256 x 256) with bf16 weights, trained for one step over n
micro-batches of 16 rows, each loss divided by n as the trainer does. Its weight
gradient comes from polytrain's ZeroDataParallel on one rank, summed over the
micro-batches:

- default: train.grad_accum_dtype = "fp32", on the device (the fp32 sum is the gradient
  shard), and with the shards offloaded to the host at stage 1 (a device fp32 sum reduced
  at the last micro-batch) and stage 2 (every micro-batch reduced into an fp32 host shard);
- param: train.grad_accum_dtype = "param", the older 16-bit sum in `param.grad`;

against the same bf16 micro-batch gradients (autograd on a plain copy of the layer)
summed in fp32, the best a sum of bf16 gradients can do. Each is compared with the exact
gradient, computed in float64 from the same (bf16-valued) inputs: the relative error
||g - exact|| / ||exact||. The inputs have a nonzero mean so that the micro-batches'
gradients point the same way and their sum grows with n, as a model's do.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

WIDTH, ROWS = 256, 16
LAYOUTS = {  # name -> (ZeRO stage, parallel.offload)
    "default": (1, "none"),
    "default stage 1 offload": (1, "cpu"),
    "default stage 2 offload": (2, "cpu"),
}


def micro_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (inputs (ROWS, WIDTH), output weights (ROWS, WIDTH)) pairs of bf16 values."""
    gen = torch.Generator().manual_seed(seed)
    return [((torch.randn(ROWS, WIDTH, generator=gen) + 1).bfloat16(),
             (torch.randn(ROWS, WIDTH, generator=gen) + 0.5).bfloat16()) for _ in range(n)]


def exact_gradient(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """d/dW of sum_i sum(x_i W^T * t_i) / n in float64: sum_i t_i^T x_i / n, (WIDTH, WIDTH)."""
    n = len(batches)
    return sum(t.double().T @ x.double() for x, t in batches) / n


def _layer(device: torch.device) -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(WIDTH, WIDTH, bias=False, device=device)


def _loss(layer: nn.Linear, x: torch.Tensor, t: torch.Tensor, n: int) -> torch.Tensor:
    return (layer(x.to(layer.weight.device)) * t.to(layer.weight.device)).sum() / n


def fp32_sum(batches, device: torch.device) -> torch.Tensor:
    """Each micro-batch's bf16 weight gradient (plain autograd) summed in fp32."""
    layer = _layer(device).bfloat16()
    total = torch.zeros(WIDTH, WIDTH, dtype=torch.float32, device=device)
    for x, t in batches:
        _loss(layer, x, t, len(batches)).backward()
        total += layer.weight.grad.float()
        layer.weight.grad = None
    return total


def zero_gradient(batches, device: torch.device, accum_dtype: torch.dtype, stage: int = 1,
                  offload: str = "none") -> torch.Tensor:
    """The weight gradient ZeroDataParallel (one rank, bf16 states) sums over the micro-batches, in fp32."""
    from polytrain.backend import get_accelerator
    from polytrain.config import TrainConfig
    from polytrain.distributed.offload import ShardStore
    from polytrain.distributed.zero import ZeroDataParallel

    zero = ZeroDataParallel(get_accelerator(), None, stage, bucket_bytes=1 << 30, store=ShardStore(offload),
                            param_dtype=torch.bfloat16, accum_dtype=accum_dtype)
    layer = zero.parallelize(_layer(device))
    zero.build_optimizer(layer, TrainConfig())
    for i, (x, t) in enumerate(batches):
        zero.before_micro_batch(layer, last=i == len(batches) - 1)
        _loss(layer, x, t, len(batches)).backward()
    (shard,) = zero.gradients()  # (WIDTH * WIDTH,): one rank's shard is the whole gradient
    zero.close()
    return shard.view(WIDTH, WIDTH).float()


def relative_error(grad: torch.Tensor, exact: torch.Tensor) -> float:
    return ((grad.cpu().double() - exact).norm() / exact.norm()).item()


def measure(n: int, device: torch.device) -> dict[str, float]:
    """Relative errors of every way of summing n micro-batches' gradients (see the module docstring)."""
    batches = micro_batches(n)
    exact = exact_gradient(batches)
    errors = {"fp32 sum": relative_error(fp32_sum(batches, device), exact)}
    for name, (stage, offload) in LAYOUTS.items():
        errors[name] = relative_error(zero_gradient(batches, device, torch.float32, stage, offload), exact)
    errors["param (16-bit sum)"] = relative_error(zero_gradient(batches, device, torch.bfloat16), exact)
    return errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[8, 64, 256])
    args = p.parse_args()
    from polytrain.backend import get_accelerator

    acc = get_accelerator()
    device = acc.device()
    print(f"Machine: {acc.describe()} | bf16 Linear {WIDTH} x {WIDTH}, {ROWS} rows per micro-batch")
    rows = {n: measure(n, device) for n in args.micro_batches}
    names = list(next(iter(rows.values())))
    print("\n| micro-batches | " + " | ".join(names) + " |")
    print("|" + " --- |" * (len(names) + 1))
    for n, errors in rows.items():
        print(f"| {n} | " + " | ".join(f"{100 * errors[k]:.2f}%" for k in names) + " |")


if __name__ == "__main__":
    main()
