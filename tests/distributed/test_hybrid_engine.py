"""The Hybrid Engine generates exactly what one device generates, for llama, gpt2 and internlm2.

One two-rank launch. Per architecture, each rank's reference is a plain single-device model
with the same seeded weights (and LoRA adapters with non-zero B, merged) and greedy
`generate` on its own three left-padded prompts. Then the same model is built in training
layouts and generates through the engine, one block gathered at a time: dp 2 ZeRO-3
without and with LoRA, tp 2 with LoRA, and ZeRO-3 with LoRA re-split to an inference tp of 2
(the tp group generating both ranks' prompts together). Every layout's tokens must equal
the reference's, token for token, as must generation through the ZeRO-3 training model
itself (no engine). A bf16 ZeRO-3 actor (fp32 masters, bf16 compute copies) generates
through a bf16 copy, its tokens equal to a bf16 single-device model's.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
ARCHS = ("llama", "gpt2", "internlm2")
NEW_TOKENS = 8


def _config(arch: str, *extra: str):
    from polytrain.config import load_config

    kv = "4" if arch == "gpt2" else "2"  # gpt2 has no grouped-query attention
    return load_config(None, ["--model.arch", arch, "--model.dim", "32", "--model.n_layers", "3", "--model.n_heads",
                              "4", "--model.n_kv_heads", kv, "--model.ffn_dim", "64", "--model.vocab_size", "128",
                              "--data.seq_len", "32", "--run.seed", "5", *extra])


@torch.no_grad()
def _set_adapters(model: torch.nn.Module) -> None:
    """B of every adapter from (name)-seeded noise, so the adapters change the tokens; any layout."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        if name.endswith(".lora_b"):
            full = 0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)


def _reference(cfg, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from polytrain.lora import apply_lora, merge_adapters
    from polytrain.models import ARCHITECTURES
    from polytrain.models.common.init import init_plain

    model = ARCHITECTURES[cfg.model.arch].build(cfg.model)
    if cfg.lora.rank:
        apply_lora(model, cfg.lora)
    init_plain(model, cfg.run.seed)
    if cfg.lora.rank:
        _set_adapters(model)
        merge_adapters(model)
    return model.to(dtype).eval()


def _generate_all(rank: int, world_size: int) -> dict[str, bool]:
    from polytrain.inference.generate import generate
    from polytrain.inference.hybrid_engine import HybridEngine
    from polytrain.train.build import build_model
    from polytrain.train.startup import plan_layout, start

    g = torch.Generator().manual_seed(100 + rank)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 7, 5)]
    results = {}
    for arch in ARCHS:
        lora = ("--lora.rank", "4", "--lora.alpha", "8")
        zero3, zero3_lora = _config(arch, "--parallel.zero", "3"), _config(arch, "--parallel.zero", "3", *lora)
        tp2_lora = _config(arch, "--parallel.tp", "2", *lora)
        runtime, _ = start(zero3)
        tp_runtime = runtime.with_dims(plan_layout(tp2_lora, world_size).dims)
        layouts = {"zero3": (zero3, runtime, 1), "zero3 lora": (zero3_lora, runtime, 1),
                   "tp2 lora": (tp2_lora, tp_runtime, 1), "zero3 lora, inference tp2": (zero3_lora, runtime, 2)}
        wants = {False: generate(_reference(zero3), prompts, NEW_TOKENS, temperature=0.0),
                 True: generate(_reference(zero3_lora), prompts, NEW_TOKENS, temperature=0.0)}
        zero3_bf16 = _config(arch, "--parallel.zero", "3", "--train.precision", "bf16")
        engine = HybridEngine(runtime, zero3_bf16, build_model(runtime, zero3_bf16).model, gather_blocks=1)
        with engine.generation_model() as copy:
            results[f"{arch} bf16 actor, bf16 copy"] = {p.dtype for p in copy.parameters()} == {torch.bfloat16}
        results[f"{arch} bf16 actor"] = (engine.generate(prompts, NEW_TOKENS, temperature=0.0)
                                         == generate(_reference(zero3, torch.bfloat16), prompts, NEW_TOKENS,
                                                     temperature=0.0))
        for name, (cfg, rt, inference_tp) in layouts.items():
            built = build_model(rt, cfg)
            _set_adapters(built.model)
            engine = HybridEngine(rt, cfg, built.model, inference_tp=inference_tp, gather_blocks=1)
            want = wants[bool(cfg.lora.rank)]
            results[f"{arch} {name}"] = engine.generate(prompts, NEW_TOKENS, temperature=0.0) == want
            if name == "zero3 lora":  # the same ranks in lock-step through FSDP: no stop tokens
                results[f"{arch} {name}, no engine"] = generate(built.model, prompts, NEW_TOKENS, temperature=0.0) == want
        results[f"{arch} lora changes the tokens"] = wants[True] != wants[False]
    return results


def test_engine_generation_equals_single_device():
    for rank, results in enumerate(run_ranks(2, _generate_all)):
        assert len(results) == 3 * 8
        failed = [what for what, ok in results.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
