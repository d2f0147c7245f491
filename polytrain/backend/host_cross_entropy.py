"""The chunked loss's softmax on the host CPU: `chunk_lse` and `chunk_grad`, C++ operators
(host_cross_entropy.cpp).

The chunked loss (distributed/linear_cross_entropy.py) turns each chunk's logits (C, V) into
their log-sum-exp per token and then into d(loss)/d(logits) = softmax - one_hot. In torch ops
that is a dozen passes over the chunk: the bf16 logits widened to an fp32 copy, logsumexp's
maximum, exponentials and sum, widened again, the subtraction, the exponentials in place, the
targets' -1 scattered, the result rounded back to bf16, each pass reading and writing (C, V)
numbers beyond L2. The operators make one pass for each result, a row at a time, in fp32, the
gradient rounded once to the logits' dtype. A profile of a llama tiny ZeRO-2 bf16 step at 2
ranks (2,048 tokens x 4,096 vocabulary a rank) put those ops at ~57 ms of 391; see RESULTS.md
("The chunked loss's softmax in a host kernel") for what the operators make of it.

Built with the other host kernels (host_matmul.available()). `chunk_lse` / `chunk_grad` here take
the chunked loss's own arguments; `applies(logits)` says whether they take a chunk (fp32 or bf16
rows on the host CPU), and the loss keeps its torch ops where they do not.
"""

from __future__ import annotations

import torch

from polytrain.backend import host_matmul

DTYPES = (torch.float32, torch.bfloat16)


def applies(logits: torch.Tensor) -> bool:
    """Whether the operators take these logits (C, V): fp32 or bf16 rows on the host CPU."""
    return (logits.device.type == "cpu" and logits.dtype in DTYPES and logits.dim() == 2
            and logits.stride(-1) == 1 and host_matmul.available())


def chunk_lse(logits: torch.Tensor, target: torch.Tensor, hit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (C, V), target (C, 1) local vocabulary rows (0 where not `hit`), hit (C,) whether the
    token's target is one of these rows -> the log-sum-exp per token (C,) fp32 and the sum of the
    hit targets' logits () fp32. Only where `applies(logits)`."""
    return torch.ops.polytrain.chunk_lse(logits, target.reshape(-1), hit)


def chunk_grad(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, hit: torch.Tensor,
               keep: torch.Tensor) -> torch.Tensor:
    """softmax - one_hot(target) from logits (C, V) and the whole vocabulary's lse (C,) fp32, zero on
    rows not `keep` (unscored), in the logits' dtype. Only where `applies(logits)`."""
    return torch.ops.polytrain.chunk_grad(logits, lse.contiguous(), target.reshape(-1), hit, keep)


def _register_fakes() -> None:
    torch.library.register_fake("polytrain::chunk_lse")(
        lambda logits, target, hit: (logits.new_empty(logits.shape[0], dtype=torch.float32),
                                     logits.new_empty((), dtype=torch.float32)))
    torch.library.register_fake("polytrain::chunk_grad")(lambda logits, lse, target, hit, keep: torch.empty_like(logits))


host_matmul.when_loaded(_register_fakes)
