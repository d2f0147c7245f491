"""LoRA adapters on one process: the layer against the float64 formula, the patterns, the frozen
base (no gradients, no optimizer state: measured), merging, and the config's one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from polytrain.config import LoRAConfig, load_config
from polytrain.errors import ConfigError
from polytrain.lora import LoRALinear, apply_lora, merge_adapters, merge_state, target_names
from polytrain.models import ARCHITECTURES
from polytrain.models.common.init import init_plain
from polytrain.train.build import build_model
from polytrain.train.startup import plan_layout, start

TINY = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_dim", "64", "--model.vocab_size", "128", "--data.seq_len", "16"]


def _model(arch: str = "llama", extra: list[str] = ()):
    heads = ["--model.n_kv_heads", "4"] if arch == "gpt2" else []  # no grouped-query attention
    cfg = load_config(None, [*TINY, "--model.arch", arch, *heads, *extra])
    return cfg, ARCHITECTURES[arch].build(cfg.model)


def test_layer_matches_the_formula_in_float64():
    torch.manual_seed(0)
    base = nn.Linear(6, 5, dtype=torch.float64)
    layer = LoRALinear(base, rank=3, alpha=6.0)
    with torch.no_grad():
        layer.lora_a.normal_(), layer.lora_b.normal_()
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    want = x @ base.weight.T + base.bias + 2.0 * (x @ layer.lora_a.T @ layer.lora_b.T)  # alpha / r = 2
    torch.testing.assert_close(layer(x), want, rtol=1e-12, atol=1e-12)
    merged = merge_state({"l.weight": base.weight, "l.bias": base.bias, "l.lora_a": layer.lora_a,
                          "l.lora_b": layer.lora_b}, {"rank": 3, "alpha": 6.0})
    assert set(merged) == {"l.weight", "l.bias"}
    torch.testing.assert_close(x @ merged["l.weight"].T + merged["l.bias"], want, rtol=1e-12, atol=1e-12)


def test_patterns_pick_block_linears_by_name():
    _, llama = _model()
    assert target_names(llama, "layers") == [n for n, m in llama.named_modules()
                                            if isinstance(m, nn.Linear) and n.startswith("layers.")]
    assert target_names(llama, "wq,wv") == ["layers.0.attention.wq", "layers.0.attention.wv",
                                            "layers.1.attention.wq", "layers.1.attention.wv"]
    assert target_names(llama, "layers.1.feed_forward.w1, 0.*.wo") == ["layers.0.attention.wo",
                                                                       "layers.1.feed_forward.w1"]
    assert len(target_names(llama, "attention")) == 8
    with pytest.raises(ConfigError, match=r"pattern 'q_proj' matches no Linear .* attention.wq, attention.wv"):
        target_names(llama, "wq,q_proj")


@pytest.mark.parametrize("arch", ["llama", "gpt2", "internlm2"])
def test_adapters_start_as_the_base_and_merge_exactly(arch):
    cfg, model = _model(arch)
    base = ARCHITECTURES[arch].build(cfg.model)
    init_plain(base, 3)
    names = apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    init_plain(model, 3)  # the base weights seeded by name as before; B = 0
    ids = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(model(ids), base(ids), rtol=0, atol=0)
    with torch.no_grad():
        for name in names:
            model.get_submodule(name).lora_b.normal_(0.0, 0.1)
    adapted = model(ids)
    assert not torch.allclose(adapted, base(ids))
    merge_adapters(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(model(ids), adapted, rtol=1e-5, atol=1e-5)


def _optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.ndim > 0)


def test_frozen_base_holds_no_gradients_or_optimizer_state():
    def one_step(extra: list[str]):
        cfg = load_config(None, [*TINY, *extra])
        runtime, layout = start(cfg)
        built = build_model(runtime, cfg, layout.pipeline)
        opt = built.dp.build_optimizer(built.model, cfg.train)
        ids = torch.randint(0, 128, (2, 16))
        built.loss(built.model, [ids], ids).backward()
        built.dp.step()
        return built, opt

    full, full_opt = one_step([])
    lora, lora_opt = one_step(["--lora.rank", "4"])
    frozen = [(n, p) for n, p in lora.model.named_parameters() if not n.endswith((".lora_a", ".lora_b"))]
    assert frozen and all(not p.requires_grad and p.grad is None for _, p in frozen)
    # AdamW keeps two fp32 moments per trained element: only the adapters' now.
    assert _optimizer_bytes(lora_opt) == 2 * 4 * lora.num_adapter_params
    assert _optimizer_bytes(full_opt) == 2 * 4 * full.num_params
    # 2 blocks x rank 4 x (in + out) of wq, wo (32 -> 32), wk, wv (32 -> 2 KV heads x 8), w1, w3, w2 (32 <-> 64)
    assert lora.num_adapter_params == 2 * 4 * (2 * (32 + 32) + 2 * (32 + 16) + 3 * (32 + 64))


def test_bad_lora_settings_fail_with_one_line():
    cases = {
        ("--lora.rank", "-1"): "lora.rank = -1 must be >= 0",
        ("--lora.rank", "4", "--lora.alpha", "0"): "lora.alpha = 0.0 must be positive",
        ("--lora.rank", "4", "--lora.dropout", "1"): r"lora.dropout = 1.0 must be in \[0, 1\)",
        ("--lora.rank", "4", "--lora.targets", "wq,,wv"): "must be comma-separated module-name patterns",
    }
    for args, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*TINY, *args])
    grid = load_config(None, [*TINY, "--lora.rank", "4", "--parallel.tp", "4", "--parallel.tp_mode", "2d"])
    with pytest.raises(ConfigError, match="tp_mode = '1d' only, not '2d'"):
        plan_layout(grid, 4)
    with pytest.raises(ConfigError, match="pattern 'w9' matches no Linear"):
        plan_layout(load_config(None, [*TINY, "--lora.rank", "4", "--lora.targets", "w9"]), 1)
