"""train.compile: regional compilation of the blocks, the same losses as eager, no graph breaks."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from polytrain.config import load_config
from polytrain.models.common.kv_cache import KVCache
from polytrain.train.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.models.test_zoo import CONFIGS, make, run, tokens


@pytest.mark.parametrize("arch", CONFIGS)
def test_no_architecture_breaks_the_graph(arch):
    """Every model of the zoo traces whole (training forward, and decoding with a KV cache)."""
    model = make(arch)
    x = tokens(2, 9)
    explained = dynamo.explain(lambda t: run(model, t))(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    if arch in ("bert", "t5"):  # no causal KV cache (T5's decoder step is covered by its decode)
        return
    cache = KVCache(2, 20, pad=torch.tensor([0, 2]))
    with torch.no_grad():
        model(x, cache=cache, start_pos=0)
        explained = dynamo.explain(lambda t, p: model(t, cache=cache, start_pos=p))(x[:, :1], 9)
    assert explained.graph_break_count == 0, explained.break_reasons


def _losses(corpus, run_dir, compile_: bool, steps: int = 3, **extra):
    trainer = Trainer(load_config(None, tiny_overrides(corpus, run_dir, **{"train.compile": compile_, **extra})))
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    timer = trainer.compile_timer
    trainer.close()
    return losses, timer


def test_compiled_blocks_train_like_eager_and_share_one_graph(small_corpus, tmp_path):
    eager, _ = _losses(small_corpus, tmp_path / "eager", False)
    compiled, timer = _losses(small_corpus, tmp_path / "compiled", True)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)  # fp32, inductor's own kernels
    # Both blocks run one graph (each new graph counts once, forward and backward together); the
    # chunked loss adds its two per-chunk kernels (the tiny batch splits into equal chunks).
    assert timer.blocks == 2 and timer.graphs == 1 + 2 and timer.breaks == 0 and timer.seconds > 0
    assert "compiled 2 blocks: 3 new graph(s), 0 graph breaks" in timer.describe()


def test_compile_with_tp_and_selective_recomputation_is_refused():
    from polytrain.errors import ConfigError

    with pytest.raises(ConfigError, match="train.activation_checkpoint = 'full'"):
        load_config(None, ["--train.compile", "true", "--parallel.tp", "2",
                           "--train.activation_checkpoint", "selective"])
