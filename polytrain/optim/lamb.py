"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2).

Per tensor w with gradient g, at step t:

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)         # Adam's bias-corrected step
    u = r + wd w
    w = w - lr * (||w|| / ||u||) * u                            # ratio 1 in groups with adapt False

||.|| is the norm of the whole tensor, however it is sharded (see trust.py). The ratio is
1 where it is undefined (w or u zero) and at most trust_clip when that is > 0 (the paper's
phi clamp; 0 leaves it the identity).
"""

from __future__ import annotations

import torch

from polytrain.optim.trust import SquareSums, TrustRatioOptimizer, local_tensor


class Lamb(TrustRatioOptimizer):
    """LAMB over parameter groups with keys lr, betas, eps, weight_decay, trust_clip, adapt."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, trust_clip: float = 0.0,
                 adapt: bool = True, square_sums: SquareSums | None = None):
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"LAMB betas {betas} must lie in [0, 1)")
        if eps <= 0 or lr < 0 or weight_decay < 0 or trust_clip < 0:
            raise ValueError("LAMB needs eps > 0 and lr, weight_decay, trust_clip >= 0")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "trust_clip": trust_clip, "adapt": adapt}
        super().__init__(params, defaults, square_sums)

    def init_state(self, param: torch.Tensor) -> dict:
        # Moments shaped (and, for a DTensor, placed) like the parameter, so Distributed
        # Checkpoint reshards them with it; the step count is a host scalar, as torch's Adam.
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param)}

    def direction(self, group: dict, state: dict, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """u = r + wd w, after updating the moments; same shape as the local w."""
        beta1, beta2 = group["betas"]
        m, v = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
        state["step"] += 1
        t = state["step"].item()
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        u = (m / (1 - beta1**t)).div_(denom)
        if group["weight_decay"]:
            u.add_(w, alpha=group["weight_decay"])
        return u

    def ratio(self, group: dict, w_norm: torch.Tensor, x_norm: torch.Tensor) -> torch.Tensor:
        return w_norm / x_norm

    def apply(self, group: dict, state: dict, w: torch.Tensor, x: torch.Tensor, ratio: torch.Tensor) -> None:
        w.addcmul_(x, ratio, value=-group["lr"])
