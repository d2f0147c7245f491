"""KV-cached generation: polytrain's `generate` against transformers' `generate`, same model, one run.

    python benchmarks/generate_vs_hf.py                          # llama 125m shape, batch 4, 64 new tokens
    python benchmarks/generate_vs_hf.py --arch gpt2 --size 124m --batch 1
    python benchmarks/generate_vs_hf.py --rounds 1 --new-tokens 8 --size tiny   # a quick check it runs

A randomly initialised Hugging Face model of the preset's shape is saved and converted with
polytrain's importer, so both sides hold the same weights; the first round checks that
both produce the same greedy tokens. Then alternating rounds time greedy decoding of
--new-tokens tokens for a batch of --batch prompts of --prompt-len tokens (every row
runs to the end: no stop tokens), on the accelerator polytrain picks, in fp32 unless
--dtype bf16. Reports new tokens per second (median over rounds) and the ratio.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from polytrain.backend import get_accelerator
from polytrain.convert import load_hf
from polytrain.inference.generate import generate
from polytrain.models import ARCHITECTURES

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama", choices=("llama", "gpt2"))
    p.add_argument("--size", default="125m", help="a size preset of --arch (tiny, small, 125m / 124m, ...)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="alternating timed rounds per implementation")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    return p.parse_args()


def hf_model(arch: str, size: str, max_len: int) -> torch.nn.Module:
    s = ARCHITECTURES[arch].presets[size]
    none = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=s["dim"], n_layer=s["n_layers"], n_head=s["n_heads"],
                                      n_inner=s["ffn_dim"], vocab_size=s["vocab_size"], n_positions=max_len, **none)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=s["dim"], num_hidden_layers=s["n_layers"],
                                   num_attention_heads=s["n_heads"], num_key_value_heads=s["n_kv_heads"],
                                   intermediate_size=s["ffn_dim"], vocab_size=s["vocab_size"],
                                   max_position_embeddings=max_len, **none)
    return transformers.LlamaForCausalLM(cfg)


def main() -> None:
    args = parse_args()
    acc = get_accelerator()
    device, dtype = acc.device(), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    hf = hf_model(args.arch, args.size, args.prompt_len + args.new_tokens).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours, _ = load_hf(Path(tmp), device)
    hf, ours = hf.to(device=device, dtype=dtype), ours.to(dtype=dtype)
    vocab = hf.config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    ids = prompts.to(device)
    n = args.new_tokens

    def run_ours():
        return generate(ours, prompts.tolist(), n, temperature=0)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[:, args.prompt_len:].tolist()

    same = run_ours() == run_hf()  # also the warm-up of both
    times = {"polytrain": [], "transformers": []}
    for _ in range(args.rounds):
        for name, fn in (("polytrain", run_ours), ("transformers", run_hf)):
            acc.synchronize()
            start = time.perf_counter()
            fn()
            acc.synchronize()
            times[name].append(time.perf_counter() - start)
    rate = {k: args.batch * n / statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in ours.parameters())
    load = os.getloadavg()[0]
    print(f"\n{datetime.date.today()}, {acc.describe()}, transformers "
          f"{transformers.__version__}, load average {load:.1f} at the end")
    print(f"{args.arch} {args.size} ({params / 1e6:.0f}M parameters, random weights), {args.dtype}, batch "
          f"{args.batch}, prompt {args.prompt_len} tokens, {n} new tokens greedy, median of {args.rounds} "
          f"rounds; same tokens from both: {same}\n")
    print("| implementation | new tokens/s | ratio |\n| --- | ---: | --- |")
    print(f"| transformers `generate` | {rate['transformers']:,.1f} | |")
    print(f"| polytrain `generate` | {rate['polytrain']:,.1f} | **{rate['polytrain'] / rate['transformers']:.2f}x** |")
    if not same:
        raise SystemExit("the two implementations produced different tokens")


if __name__ == "__main__":
    main()
