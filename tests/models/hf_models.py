"""Tiny randomly initialised Hugging Face models, saved as HF directories, for parity tests.

No downloads: every model is built from a config. Weights get noise on top of
transformers' init so that norm gains are not all 1 and biases not all 0 (a swapped
or dropped bias would otherwise go unnoticed).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
# No special-token ids: greedy generation then runs its full length in both implementations.
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def build(cls, config, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return perturbed(cls(config), seed)


def gpt2(seed: int = 0, **kw):
    cfg = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=64, **NO_SPECIAL)
    return build(transformers.GPT2LMHeadModel, transformers.GPT2Config(**{**cfg, **kw}), seed)


def llama(seed: int = 0, **kw):
    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, vocab_size=101, max_position_embeddings=64, **NO_SPECIAL)
    return build(transformers.LlamaForCausalLM, transformers.LlamaConfig(**{**cfg, **kw}), seed)


def bert(seed: int = 0, **kw):
    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               vocab_size=101, max_position_embeddings=64)
    return build(transformers.BertForMaskedLM, transformers.BertConfig(**{**cfg, **kw}), seed)


def t5(seed: int = 0, untied: bool = False, **kw):
    """T5 v1.0 by default; untied=True gives the output its own weights, as v1.1 checkpoints have."""
    cfg = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=101,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=None)
    if untied:
        cfg["tie_word_embeddings"] = False
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**{**cfg, **kw}))
    if untied:  # transformers 5 ties lm_head to the embedding in memory; T5 v1.1 files do not
        model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape) * 0.2)
    return perturbed(model, seed)


def save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def pack_wqkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv: int) -> torch.Tensor:
    """InternLM2's grouped wqkv rows from separate q (H*D, dim), k and v (Hkv*D, dim) weights:
    per key/value head g, its query heads, then k_g, then v_g (the remote code's
    'b q (h gs d) -> b q h gs d' with gs = n_rep + 2)."""
    dim = q.shape[1]
    head_dim = k.shape[0] // n_kv
    groups = [q.view(n_kv, -1, head_dim, dim), k.view(n_kv, 1, head_dim, dim), v.view(n_kv, 1, head_dim, dim)]
    return torch.cat(groups, dim=1).reshape(-1, dim)


def internlm2_dir(reference: torch.nn.Module, path: Path) -> Path:
    """An InternLM2 checkpoint directory (remote-code layout) holding the weights of an HF Llama.

    InternLM2 is Llama with q/k/v packed into wqkv and its own names, so the Llama computes
    exactly what the InternLM2 checkpoint should.
    """
    c, sd = reference.config, reference.state_dict()
    out = {"model.tok_embeddings.weight": sd["model.embed_tokens.weight"],
           "model.norm.weight": sd["model.norm.weight"], "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        a, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}."
        out[p + "attention.wqkv.weight"] = pack_wqkv(sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                                                     sd[a + "v_proj.weight"], c.num_key_value_heads)
        out[p + "attention.wo.weight"] = sd[a + "o_proj.weight"]
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[p + f"feed_forward.{ours}.weight"] = sd[f"{p}mlp.{theirs}.weight"]
        out[p + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[p + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    if c.tie_word_embeddings:
        del out["output.weight"]
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    rope = c.rope_parameters
    config = {"model_type": "internlm2", "architectures": ["InternLM2ForCausalLM"],
              "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size, "hidden_act": "silu",
              "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
              "bias": False, "rope_theta": rope["rope_theta"], "tie_word_embeddings": c.tie_word_embeddings,
              "rope_scaling": ({"type": rope["rope_type"], "factor": rope["factor"]}
                               if rope["rope_type"] != "default" else None)}
    (path / "config.json").write_text(json.dumps(config))
    return path
