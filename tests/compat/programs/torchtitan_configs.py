"""A torchtitan config registry of one's own (`--module tests.compat.programs.torchtitan_configs
--config llama3_debugmodel_cpu`), as torchtitan's docs describe for custom runs: its llama3
debug model and training recipe, with what torch 2.13 cannot do on a CPU replaced.

- attention: torch 2.13 has no FlexAttention backward on the CPU, so the debug model's
  block-causal masks are applied by SDPA instead (`MaskedSDPAttention`: the same mask, the
  same result);
- no CUDA graph capture of the step (torchtitan's default): graphs replay GPU kernels, which a
  CPU does not have (the shim refuses torch.cuda.graph with a one-line error);
- the partial-DTensor SPMD path (FSDP2 over the 'fsdp' mesh): the default spmd_types path
  needs FSDP's DTensor-free `dp_mesh_dims` sharding of a newer torch than 2.13;
- `torch.distributed.set_timeout`, which torchtitan calls after the first step, is the public
  name a newer torch gives what torch 2.13 calls `distributed_c10d._set_pg_timeout`.
None of these is about CUDA: they are torchtitan 0.3.0 (made for torch nightlies) on torch 2.13.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel


class MaskedSDPAttention(FlexAttention):
    """FlexAttention's interface and BlockMask, computed by SDPA with the dense mask."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks, scale=None, enable_gqa=False, **kwargs) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # (B, N, L, H)
        mask = create_mask(attention_masks.mask_mod, q.shape[0], None, q.shape[2], k.shape[2],
                           device=q.device)  # (B, 1, L, L) bool
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=enable_gqa)
        return out.transpose(1, 2)


if not hasattr(dist, "set_timeout"):
    dist.set_timeout = dist.distributed_c10d._set_pg_timeout


def llama3_debugmodel_cpu():
    config = llama3_debugmodel()
    for _, _, parent, field in config.model_spec.model.traverse(FlexAttention.Config):
        setattr(parent, field, MaskedSDPAttention.Config())
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"
    return config
