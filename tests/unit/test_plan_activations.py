"""The planner's activation formulas against the tensors autograd really saves for polytrain's blocks.

The reference is independent of the formulas: a saved-tensors hook records every tensor
autograd keeps from a real forward (deduplicated by storage), less the parameters; the
16-bit weight copies autocast makes are separated by running two batch sizes (they do
not grow with the tokens).
"""

from __future__ import annotations

import pytest
import torch

from polytrain.config import load_config
from polytrain.distributed.activation_checkpoint import apply_activation_checkpointing
from polytrain.models import ARCHITECTURES
from polytrain.plan.activations import (
    BlockDims,
    autocast_weight_bytes,
    block_bytes_per_token,
    block_family,
    head_bytes_per_token,
)
from polytrain.plan.shapes import model_shape

SEQ = 32


def _saved_bytes(model: torch.nn.Module, tokens: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of the distinct storages autograd saves in `model(tokens)`, parameters and buffers aside."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            model(tokens)
    return sum(seen.values())


def _model(arch: str, layers: int, recompute: str):
    cfg = load_config(None, ["--model.arch", arch, "--model.size", "tiny", "--model.n_layers", str(layers),
                             "--data.seq_len", str(SEQ), "--model.n_heads", "4", "--model.n_kv_heads",
                             "1" if ARCHITECTURES[arch].gqa else "4", "--train.activation_checkpoint", recompute])
    torch.manual_seed(0)
    model = ARCHITECTURES[arch].build(cfg.model)
    apply_activation_checkpointing(model, recompute)
    return cfg, model


@pytest.mark.parametrize("arch", ["llama", "internlm2", "gpt2", "bert"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_block_and_head_bytes_match_saved_tensors(arch, precision):
    dtype = None if precision == "fp32" else torch.bfloat16
    cb = 4 if dtype is None else 2
    for recompute in ("none", "selective", "full"):
        measured = {}
        for layers in (1, 2):
            cfg, model = _model(arch, layers, recompute)
            for batch in (2, 4):
                measured[layers, batch] = _saved_bytes(model, torch.randint(0, 100, (batch, SEQ)), dtype)
        m = cfg.model
        family = block_family(arch)
        dims = BlockDims(m.dim, m.ffn_dim, m.n_heads, m.dim // m.n_heads, m.n_kv_heads)
        # One more block, at 2 and 4 sequences: the growth per token, and what does not grow.
        block2 = measured[2, 2] - measured[1, 2]
        block4 = measured[2, 4] - measured[1, 4]
        per_token = (block4 - block2) / (2 * SEQ)
        assert per_token == pytest.approx(block_bytes_per_token(family, dims, cb, recompute=recompute), rel=1e-3), \
            (arch, precision, recompute)
        shape = model_shape(cfg)
        matrices = shape.units["layers.0"].matrices + shape.units["layers.0"].kv
        assert block2 - per_token * 2 * SEQ == pytest.approx(autocast_weight_bytes(matrices, cb, recompute), abs=64)
        if recompute == "none":  # the embedding's and head's, per token
            rest = (measured[1, 4] - measured[1, 2]) / (2 * SEQ) - per_token
            assert rest == pytest.approx(head_bytes_per_token(family, m.dim, cb), rel=1e-3)


def test_unmodelled_architecture_is_named():
    from polytrain.errors import ConfigError

    with pytest.raises(ConfigError, match="model.arch = 't5' is not one of them"):
        block_family("t5")
