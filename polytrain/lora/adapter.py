"""Low-rank adapters on a plain model's Linear layers (Hu et al. 2021, DeepSpeed-Chat's LoRA).

    names = apply_lora(model, cfg.lora)   # on the meta device, before tensor and data parallelism
    merge_adapters(model)                 # W <- W + (alpha / r) B A; the layers become nn.Linear again

A target Linear becomes a `LoRALinear` that keeps its `weight` (out, in) and `bias` (out,)
under the same names, so a checkpoint of the base model loads into it, and adds

    lora_a (r, in)    Kaiming-uniform like nn.Linear's weight (PEFT's default), seeded by name
    lora_b (out, r)   zeros: the adapted model starts as the base model

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

The model's classes are untouched: the layer objects are swapped and the model's
`init_parameter` learns the two new names, which materialize calls per parameter.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.config import LoRAConfig
from polytrain.errors import ConfigError


class LoRALinear(nn.Linear):
    """An nn.Linear plus a low-rank update; built from an existing Linear, sharing its parameters."""

    product = staticmethod(F.linear)
    """How its products run, (x, weight, bias=None) -> x weight^T + bias: train.matmul_fp32 sets
    an fp32-GEMM one on the instance."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # not nn.Linear's: the weight and bias already exist
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        like = dict(device=linear.weight.device, dtype=linear.weight.dtype)
        self.lora_a = nn.Parameter(torch.zeros(rank, self.in_features, **like))  # (r, in)
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, **like))  # (out, r)
        self.rank, self.scaling, self.dropout = rank, alpha / rank, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = lora_update(x, self.lora_a, self.lora_b, self.scaling, self.dropout, self.training, self.product)
        return self.product(x, self.weight, self.bias) + update

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}, scaling={self.scaling:g}")


def lora_update(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, dropout: float,
                training: bool, product=F.linear) -> torch.Tensor:
    """scaling * dropout(x) a^T b^T: x (..., in) -> (..., out) for a (r, in), b (out, r), or shards of
    them, each product by `product(x, weight)` (LoRALinear.product)."""
    h = F.dropout(x, dropout, training) if dropout else x
    return scaling * product(product(h, a), b)  # (..., r) -> (..., out)


def _patterns(targets: str) -> list[list[str]]:
    return [p.strip().split(".") for p in targets.split(",")]


def _appears(pattern: list[str], parts: list[str]) -> bool:
    """Whether `pattern`'s components occur in a row in `parts` ("*" matches any one component)."""
    n = len(pattern)
    return any(all(w in ("*", h) for w, h in zip(pattern, parts[i:i + n])) for i in range(len(parts) - n + 1))


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers inside the blocks (`layers.<i>....`), by name: what adapters may go on."""
    # Adapters go inside the blocks only: the output head is replaced by the chunked loss
    # head or split by vocabulary, and embeddings are not Linear layers.
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")}


def _picked(linears: dict[str, nn.Linear], targets: str) -> list[str]:
    patterns = _patterns(targets)
    return [n for n in linears if any(_appears(p, n.split(".")) for p in patterns)]


def target_names(model: nn.Module, targets: str) -> list[str]:
    """Names of the block Linear layers of `model` that any pattern of `targets` picks, in model order.

    ConfigError when a pattern picks none (naming the block Linears there are).
    """
    linears = block_linears(model)
    for pattern in _patterns(targets):
        if not any(_appears(pattern, n.split(".")) for n in linears):
            kinds = sorted({n.split(".", 2)[2] for n in linears})
            raise ConfigError(f"lora.targets pattern {'.'.join(pattern)!r} matches no Linear layer inside the "
                              f"blocks; the blocks' Linear layers are {', '.join(kinds)}")
    return _picked(linears, targets)


def adapter_parameter_count(model: nn.Module, cfg: LoRAConfig) -> int:
    """Parameters the adapters of `cfg` add to `model` (a whole model, e.g. on the meta device)."""
    linears = block_linears(model)
    return sum(cfg.rank * (linears[n].in_features + linears[n].out_features) for n in target_names(model, cfg.targets))


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Swap the target Linear layers of `model` for LoRALinear ones, in place; returns their names.

    With `cfg.only_optimize` every other parameter stops requiring gradients. `model` (or a
    pipeline stage of it, whose patterns may then match only some layers) provides
    `init_parameter`, taught here to initialise the adapters by their names.
    """
    linears = block_linears(model)
    names = _picked(linears, cfg.targets)
    if any(isinstance(linears[n], LoRALinear) for n in names):
        raise ValueError("apply_lora: the model already has adapters")
    if cfg.only_optimize:
        for param in model.parameters():
            param.requires_grad_(False)
    for name in names:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, LoRALinear(linears[name], cfg.rank, cfg.alpha, cfg.dropout))
    _teach_init(model)
    return names


def _teach_init(model: nn.Module) -> None:
    inner = model.init_parameter

    def init_parameter(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if name.endswith(".lora_a"):  # (r, in): nn.Linear's Kaiming-uniform, bound 1 / sqrt(in)
            bound = 1.0 / math.sqrt(tensor.shape[1])
            tensor.uniform_(-bound, bound, generator=generator)
        elif name.endswith(".lora_b"):
            tensor.zero_()
        else:
            inner(name, tensor, generator)

    model.init_parameter = init_parameter


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Fuse every LoRALinear of a plain (single-device) model into its weight and make it an
    nn.Linear again (same weight and bias objects); returns `model`."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            at = torch.promote_types(module.weight.dtype, torch.float32)
            delta = module.scaling * (module.lora_b.to(at) @ module.lora_a.to(at))  # (out, in)
            module.weight.add_(delta.to(module.weight.dtype))
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            plain.weight, plain.bias = module.weight, module.bias
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, plain)
    return model
