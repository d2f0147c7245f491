"""Greedy generation: polytrain's `generate` against transformers' `generate`, same weights, one run.

    python benchmarks/generate_vs_hf.py                          # llama 125m shape, batch 1 and 8, 64 new tokens
    python benchmarks/generate_vs_hf.py --arch gpt2 --size 124m
    python benchmarks/generate_vs_hf.py --size tiny --rounds 1 --new-tokens 8 --batches 2   # a quick check it runs

A randomly initialised Hugging Face model of the preset's shape is saved and converted with
polytrain's importer, so both sides hold the same weights. Each side runs these ways:

    polytrain     padded     the KV cache that grows with the sequence (generate's default)
                  F.linear   padded, decoding's products all F.linear: neither streamed through the host
                             kernel nor split over threads (threaded_matmul=False)
                  static     a fixed-shape StaticKVCache (static_cache=True)
                  compiled   the static cache's decoding step compiled once (compile=True)
    transformers  dynamic    its default DynamicCache
                  static     cache_implementation="static"
                  compiled   static, with its automatic compilation of the decoding forward
                             (which it turns on by itself only on GPUs; forced here on the CPU)

The first call of each checks that all seven produce the same greedy tokens and pays their
compilation (reported). Then --rounds rounds, the order rotating each round, time greedy
decoding of --new-tokens tokens (every row runs to the end: no stop tokens) for --batch
prompts of --prompt-len tokens, on the accelerator polytrain picks, fp32 unless --dtype bf16.
Reports new tokens per second (median and spread over rounds) and the ratios of
polytrain's to transformers' way with the same kind of cache, and best against best.
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
HF_WAYS = {"padded": "dynamic", "F.linear": "dynamic", "static": "static", "compiled": "compiled"}  # same cache


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama", choices=("llama", "gpt2"))
    p.add_argument("--size", default="125m", help="a size preset of --arch (tiny, small, 125m / 124m, ...)")
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of every way")
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


def runners(ours, hf, prompts: torch.Tensor, n: int, device) -> dict:
    """name -> a function running one greedy generation of `prompts` (B, L), returning new tokens."""
    ids = prompts.to(device)
    compile_all = transformers.CompileConfig()
    compile_all._compile_all_devices = True  # transformers compiles by itself only on GPUs

    def ours_way(**kw):
        return lambda: generate(ours, prompts.tolist(), n, temperature=0, **kw)

    def hf_way(**kw):
        def run():
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
            return out[:, prompts.shape[1]:].tolist()
        return run

    return {("polytrain", "padded"): ours_way(), ("polytrain", "F.linear"): ours_way(threaded_matmul=False),
            ("polytrain", "static"): ours_way(static_cache=True),
            ("polytrain", "compiled"): ours_way(compile=True),
            ("transformers", "dynamic"): hf_way(),
            ("transformers", "static"): hf_way(cache_implementation="static", disable_compile=True),
            ("transformers", "compiled"): hf_way(cache_implementation="static", compile_config=compile_all)}


def warm_up(ways: dict) -> tuple[dict, dict]:
    """The first call of every way (it compiles what compiles): (seconds, output) per name."""
    first, outputs = {}, {}
    for name, fn in ways.items():
        start = time.perf_counter()
        outputs[name] = fn()
        first[name] = time.perf_counter() - start
    return first, outputs


def timed_rounds(ways: dict, rounds: int, acc, reference=None) -> tuple[dict, set]:
    """Seconds of each call over `rounds` rounds of every way, the order rotating each round;
    and the names of the ways that returned something other than `reference` (when given)."""
    times, different, names = {name: [] for name in ways}, set(), list(ways)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            acc.synchronize()
            start = time.perf_counter()
            out = ways[name]()
            acc.synchronize()
            times[name].append(time.perf_counter() - start)
            if reference is not None and out != reference:
                different.add(name)
    return times, different


def measure(ours, hf, batch: int, args, acc, device) -> dict:
    prompts = torch.randint(0, hf.config.vocab_size, (batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(batch))
    ways = runners(ours, hf, prompts, args.new_tokens, device)
    first, tokens = warm_up(ways)
    reference = tokens["transformers", "dynamic"]
    same = {name: out == reference for name, out in tokens.items()}
    times, _ = timed_rounds(ways, args.rounds, acc)
    rates = {name: [batch * args.new_tokens / t for t in ts] for name, ts in times.items()}
    return {"batch": batch, "rates": rates, "median": {k: statistics.median(v) for k, v in rates.items()},
            "first_call_s": first, "same_tokens": same}


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
    load = os.getloadavg()[0]
    results = [measure(ours, hf, int(b), args, acc, device) for b in args.batches.split(",")]
    params = sum(p.numel() for p in ours.parameters())
    print(f"\n{datetime.date.today()}, {acc.describe()}, transformers {transformers.__version__}, "
          f"load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at the end")
    print(f"{args.arch} {args.size} ({params / 1e6:.0f}M parameters, random weights), {args.dtype}, prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens greedy, median (spread) of {args.rounds} "
          f"rounds\n")
    print("| batch | implementation | cache | new tokens/s (spread) | first call s | same tokens | "
          "polytrain / transformers, same cache |\n| ---: | --- | --- | ---: | ---: | --- | ---: |")
    ok = True
    for res in results:
        med = res["median"]
        for (impl, way), rate in med.items():
            spread = f"{min(res['rates'][impl, way]):,.1f}-{max(res['rates'][impl, way]):,.1f}"
            ratio = f"**{rate / med['transformers', HF_WAYS[way]]:.2f}x**" if impl == "polytrain" else ""
            print(f"| {res['batch']} | {impl} | {way} | {rate:,.1f} ({spread}) | "
                  f"{res['first_call_s'][impl, way]:.1f} | {res['same_tokens'][impl, way]} | {ratio} |")
        best = {impl: max(r for (i, _), r in med.items() if i == impl) for impl in ("polytrain", "transformers")}
        print(f"| {res['batch']} | best of each | | | | | **{best['polytrain'] / best['transformers']:.2f}x** |")
        ok &= all(res["same_tokens"].values())
    if not ok:
        raise SystemExit("the implementations produced different tokens")


if __name__ == "__main__":
    main()
