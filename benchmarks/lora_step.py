"""LoRA training step: polytrain's adapters against full fine-tuning and against PEFT, same model.

    python benchmarks/lora_step.py                 # ~3 min on 2 cores
    python benchmarks/lora_step.py --dim 256 --layers 4 --reps 3  # a quick check that it runs

One Llama shape (default dim 512, 8 blocks, 8 heads / 4 KV heads, FFN 1408, vocabulary 8192:
~27M parameters), micro-batch 4 x 256 tokens, AdamW, fp32, one thread. Four ways, each in a
fresh process:

    polytrain full     every parameter trains (build_model + its optimizer)
    polytrain lora     lora.rank 8 on every block Linear, base frozen (lora.only_optimize)
    peft lora          transformers' LlamaForCausalLM of the same shape with PEFT LoRA r 8 on
                       q/k/v/o/gate/up/down_proj, AdamW over its trainable parameters
    transformers full  the same HF model, every parameter trains

Reported per way: the median seconds of a training step (forward, backward, optimizer step)
over --reps steps after one warm-up step, the peak resident memory the steps add (VmHWM reset
through /proc/self/clear_refs; Linux only), the optimizer state's bytes, trainable parameters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

WAYS = ("polytrain full", "polytrain lora", "peft lora", "transformers full")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _polytrain(args, lora: bool):
    from polytrain.config import load_config
    from polytrain.train.build import build_model
    from polytrain.train.startup import start

    overrides = ["--model.size", "custom", "--model.dim", str(args.dim), "--model.n_layers", str(args.layers),
                 "--model.n_heads", "8", "--model.n_kv_heads", "4", "--model.ffn_dim", str(args.ffn),
                 "--model.vocab_size", str(args.vocab), "--data.seq_len", str(args.seq),
                 "--train.micro_batch_size", str(args.batch), "--train.global_batch_size", str(args.batch)]
    if lora:
        overrides += ["--lora.rank", str(args.rank), "--lora.alpha", str(2 * args.rank)]
    cfg = load_config(None, overrides)
    runtime, layout = start(cfg)
    built = build_model(runtime, cfg, layout.pipeline)
    optimizer = built.dp.build_optimizer(built.model, cfg.train)

    def step(ids):
        built.loss(built.model, [ids], ids).backward()
        built.dp.step()
        built.dp.zero_grad()

    return step, optimizer, sum(p.numel() for p in built.model.parameters() if p.requires_grad)


def _hf(args, lora: bool):
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=args.dim, num_hidden_layers=args.layers, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=args.ffn, vocab_size=args.vocab,
                                      max_position_embeddings=args.seq)
    model = transformers.LlamaForCausalLM(config).train()
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                            target_modules=HF_TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, optimizer, sum(p.numel() for p in params)


def measure(way: str, args) -> dict:
    """One way, in this process."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    make = _polytrain if way.startswith("polytrain") else _hf
    step, optimizer, trainable = make(args, lora=way.endswith("lora"))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    step(ids)  # warm-up: first-touch allocations, gradient buffers, optimizer state
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _rss_mib("VmRSS")
    seconds = []
    for _ in range(args.reps):
        start = time.perf_counter()
        step(ids)
        seconds.append(time.perf_counter() - start)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.ndim > 0)
    return {"way": way, "step_s": statistics.median(seconds), "peak_added_mib": _rss_mib("VmHWM") - before,
            "rss_mib": _rss_mib("VmHWM"), "optimizer_mib": state / 2**20, "trainable": trainable}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # the child process's one way
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(args.way, args)))
        return
    passed = [a for a in sys.argv[1:]]
    rows = []
    for way in WAYS:
        out = subprocess.run([sys.executable, __file__, *passed, "--way", way], check=True,
                             capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    full = {r["way"].split()[0]: r for r in rows if r["way"].endswith("full")}
    print(f"Llama dim {args.dim} x {args.layers} blocks, vocab {args.vocab}; micro-batch {args.batch} x {args.seq}; "
          f"LoRA r {args.rank}; AdamW fp32, 1 thread\n")
    print("| way | trainable params | step (s) | vs its full | optimizer state (MiB) | peak RSS (MiB) | "
          "peak added by steps (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ref = full["polytrain" if r["way"].startswith("polytrain") else "transformers"]
        print(f"| {r['way']} | {r['trainable'] / 1e6:.2f}M | {r['step_s']:.3f} | {r['step_s'] / ref['step_s']:.2f}x | "
              f"{r['optimizer_mib']:.1f} | {r['rss_mib']:.0f} | {r['peak_added_mib']:.0f} |")
    lora = {r["way"]: r for r in rows}
    print(f"\npolytrain lora / peft lora: step time {lora['polytrain lora']['step_s'] / lora['peft lora']['step_s']:.2f}x, "
          f"peak RSS {lora['polytrain lora']['rss_mib'] / lora['peft lora']['rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
