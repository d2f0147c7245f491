"""LARS (You et al. 2017, "Large Batch Training of Convolutional Networks", Algorithm 1).

Per tensor w with gradient g:

    ratio = ||w|| / (||g|| + wd ||w||)                          # 1 in groups with adapt False
    v = momentum v + lr * ratio * (g + wd w)
    w = w - v

||.|| is the norm of the whole tensor, however it is sharded (see trust.py). The paper's
trust coefficient eta multiplies the ratio just as lr does, so train.lr stands for
lr x eta here: with the paper's eta = 0.001, lr = 0.001 x its global rate. Groups with
adapt False (biases, norm gains) take plain momentum SGD at train.lr. The ratio is 1
where it is undefined and at most trust_clip when that is > 0.
"""

from __future__ import annotations

import torch

from polytrain.optim.trust import SquareSums, TrustRatioOptimizer, local_tensor


class Lars(TrustRatioOptimizer):
    """LARS over parameter groups with keys lr, momentum, weight_decay, trust_clip, adapt."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_clip: float = 0.0, adapt: bool = True, square_sums: SquareSums | None = None):
        if not 0 <= momentum < 1:
            raise ValueError(f"LARS momentum {momentum} must lie in [0, 1)")
        if lr < 0 or weight_decay < 0 or trust_clip < 0:
            raise ValueError("LARS needs lr, weight_decay, trust_clip >= 0")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_clip": trust_clip, "adapt": adapt}
        super().__init__(params, defaults, square_sums)

    def init_state(self, param: torch.Tensor) -> dict:
        # v starts at zero (the paper's v_0); shaped and placed like the parameter.
        return {"momentum_buffer": torch.zeros_like(param)}

    def direction(self, group: dict, state: dict, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The gradient: its norm is the ratio's."""
        return g

    def ratio(self, group: dict, w_norm: torch.Tensor, x_norm: torch.Tensor) -> torch.Tensor:
        return w_norm / (x_norm + group["weight_decay"] * w_norm)

    def apply(self, group: dict, state: dict, w: torch.Tensor, x: torch.Tensor, ratio: torch.Tensor) -> None:
        step = x.add(w, alpha=group["weight_decay"]) if group["weight_decay"] else x  # g + wd w
        v = local_tensor(state["momentum_buffer"])
        v.mul_(group["momentum"]).addcmul_(step, ratio, value=group["lr"])
        w.sub_(v)
