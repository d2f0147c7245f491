"""A rollout's generation: many prompts whose answers end at different lengths, polytrain against transformers.

    python benchmarks/rollout_generation.py                     # llama 125m shape, 32 prompts, 8 rows at a time
    python benchmarks/rollout_generation.py --size tiny --prompts 6 --rows 2 --new-tokens 8 --rounds 1   # a check it runs

RLHF's step 3 generates answers to a batch of prompts, and the answers end when they end: a
few tokens for one, the length limit for another. Generating them a fixed number of rows
at a time, each group runs until its longest row is done while the finished rows compute
padding; continuous batching instead gives a finished row's slot to the next prompt. This
script measures that workload on both sides, with the same weights (a randomly initialised
Hugging Face model of the preset's shape, converted with polytrain's importer) and the same
limit of --rows sequences in flight:

    polytrain     continuous   generate(..., batch_size=rows): static KV cache, a finished row refilled
                  compiled     the same with its decoding step compiled (compile=True)
                  groups       generate's default padded batches, --rows prompts at a time
    transformers  groups       generate(), --rows prompts at a time (its default DynamicCache)
                  continuous   generate_batch() with max_requests_per_batch = rows (its paged
                               continuous batching; its manager kept between calls and no
                               warm-up pass, its fastest setting on a CPU)

Decoding is greedy; a row ends at its first token whose id is divisible by --stop-every
(1 in --stop-every of the vocabulary are stop tokens; with random weights that spreads the
answers' lengths from 1 token to the limit; the lengths are printed) or after --new-tokens.
The first call of each way pays compilation (reported). Then --rounds rounds, the order
rotating each round; every call's tokens must equal transformers' groups' first call. Reported: useful new tokens per
second (each answer's tokens up to and including its stop token; padding does not count),
median and spread over rounds, and polytrain's best way against transformers' best.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import tempfile
from pathlib import Path

import torch
import transformers

from polytrain.backend import get_accelerator
from polytrain.convert import load_hf
from polytrain.inference.generate import generate, until_stop

from generate_vs_hf import hf_model, timed_rounds, warm_up  # (this directory) the same model and timing

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # "manager kept alive" on every call


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama", choices=("llama", "gpt2"))
    p.add_argument("--size", default="125m", help="a size preset of --arch")
    p.add_argument("--prompts", type=int, default=32, help="prompts of the rollout")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128, help="the answers' length limit")
    p.add_argument("--rows", type=int, default=8, help="sequences in flight at once, on both sides")
    p.add_argument("--stop-every", type=int, default=16, help="token ids divisible by this are stop tokens")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    for name in ("prompts", "prompt_len", "new_tokens", "rows", "stop_every", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def runners(ours, hf, prompts: list[list[int]], args, device) -> dict:
    """(implementation, way) -> a function generating every prompt's answer (list of token lists)."""
    n, rows = args.new_tokens, args.rows
    stops = sorted(t for t in range(hf.config.vocab_size) if t % args.stop_every == 0)
    stop_set = set(stops)

    def ours_way(**kw):
        return lambda: generate(ours, prompts, n, temperature=0, stop_tokens=stop_set, **kw)

    def ours_groups():
        return [new for i in range(0, len(prompts), rows)
                for new in generate(ours, prompts[i:i + rows], n, temperature=0, stop_tokens=stop_set)]

    def hf_groups():
        out = []
        for i in range(0, len(prompts), rows):
            ids = torch.tensor(prompts[i:i + rows], device=device)
            with torch.no_grad():
                new = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  do_sample=False, eos_token_id=stops, pad_token_id=0)
            # transformers pads a finished row after its stop token
            out += [until_stop(row, stop_set) for row in new[:, ids.shape[1]:].tolist()]
        return out

    config = transformers.GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=stops, pad_token_id=0)
    batching = transformers.ContinuousBatchingConfig(max_requests_per_batch=rows)

    def hf_continuous():
        done = hf.generate_batch(prompts, generation_config=config, continuous_batching_config=batching,
                                 warmup=False, persistent_manager=True)
        order = sorted(done.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[1]))  # "req_<i>"
        return [list(o.generated_tokens) for o in order]

    return {("polytrain", "continuous"): ours_way(batch_size=rows),
            ("polytrain", "compiled"): ours_way(batch_size=rows, compile=True),
            ("polytrain", "groups"): ours_groups,
            ("transformers", "groups"): hf_groups,
            ("transformers", "continuous"): hf_continuous}


def main() -> None:
    args = parse_args()
    acc = get_accelerator()
    device = acc.device()
    torch.manual_seed(0)
    hf = hf_model(args.arch, args.size, args.prompt_len + args.new_tokens).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours, _ = load_hf(Path(tmp), device)
    hf = hf.to(device)
    prompts = torch.randint(0, hf.config.vocab_size, (args.prompts, args.prompt_len),
                            generator=torch.Generator().manual_seed(1)).tolist()
    ways = runners(ours, hf, prompts, args, device)
    load = os.getloadavg()[0]

    first, answers = warm_up(ways)
    reference = answers["transformers", "groups"]
    useful = sum(map(len, reference))
    times, different = timed_rounds(ways, args.rounds, acc, reference)
    different |= {name for name, out in answers.items() if out != reference}
    rates = {name: [useful / t for t in ts] for name, ts in times.items()}
    median = {name: statistics.median(v) for name, v in rates.items()}

    lengths = sorted(map(len, reference))
    params = sum(p.numel() for p in ours.parameters())
    print(f"\n{datetime.date.today()}, {acc.describe()}, transformers {transformers.__version__}, "
          f"load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at the end")
    print(f"{args.arch} {args.size} ({params / 1e6:.0f}M parameters, random weights), fp32, {args.prompts} prompts "
          f"of {args.prompt_len} tokens, answers up to {args.new_tokens} tokens, greedy, stop tokens: ids divisible "
          f"by {args.stop_every}; {args.rows} rows in flight; median (spread) of {args.rounds} rounds")
    print(f"answer lengths: min {lengths[0]}, median {statistics.median(lengths):g}, mean "
          f"{statistics.mean(lengths):.1f}, max {lengths[-1]}; {sum(n == args.new_tokens for n in lengths)} of "
          f"{len(lengths)} at the limit; {useful} useful tokens\n")
    print("| implementation | way | useful new tokens/s (spread) | first call s |\n| --- | --- | ---: | ---: |")
    for (impl, way), rate in median.items():
        spread = f"{min(rates[impl, way]):,.1f}-{max(rates[impl, way]):,.1f}"
        print(f"| {impl} | {way} | {rate:,.1f} ({spread}) | {first[impl, way]:.1f} |")
    best = {impl: max((r, w) for (i, w), r in median.items() if i == impl) for impl in ("polytrain", "transformers")}
    print(f"\nbest of each: polytrain {best['polytrain'][1]} / transformers {best['transformers'][1]} = "
          f"**{best['polytrain'][0] / best['transformers'][0]:.2f}x**")
    if different:
        raise SystemExit(f"these ways produced other tokens than transformers' groups: {sorted(different)}")


if __name__ == "__main__":
    main()
