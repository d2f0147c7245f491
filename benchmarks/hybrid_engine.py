"""Step-3 generation: the Hybrid Engine against generating through the ZeRO-3 model, and TRL.

    python benchmarks/hybrid_engine.py --trl-python /path/to/venv-with-trl/bin/python   # ~5 min, 2 cores
    python benchmarks/hybrid_engine.py --dim 128 --layers 2 --new-tokens 8               # a quick check

An actor of one Llama shape (default dim 512, 8 blocks, 8 heads / 4 KV heads, FFN 1408,
vocabulary 8192: ~27M parameters) with LoRA r 8 on every block Linear (B non-zero), trained
at dp 2 with ZeRO-3 on two gloo ranks of one thread each. Each rank continues its own 4
left-padded prompts (16-40 tokens) by --new-tokens greedy tokens:

    engine       HybridEngine.generate: gather the shards once (one block at a time), fuse the
                 adapters, generate on the plain copy, release it
    no engine    polytrain's generate through the ZeRO-3 training model (every block all-gathered
                 for every token)
    trl          TRL's unwrap_model_for_generation + transformers' generate on the same shape with
                 PEFT LoRA r 8 (two processes of one thread at once, each one rank's 4 prompts), in
                 the Python given by --trl-python (TRL is not a polytrain dependency)

Reported: generated tokens per second per rank, the engine's gather and generate seconds and
each phase's peak resident memory (VmHWM reset before the phase; Linux), and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

PROMPT_LENGTHS = (16, 24, 32, 40)


def _prompts(rank: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _overrides(args) -> list[str]:
    return ["--model.size", "custom", "--model.dim", str(args.dim), "--model.n_layers", str(args.layers),
            "--model.n_heads", "8", "--model.n_kv_heads", "4", "--model.ffn_dim", str(args.ffn),
            "--model.vocab_size", str(args.vocab), "--data.seq_len", str(max(PROMPT_LENGTHS) + args.new_tokens),
            "--parallel.zero", "3", "--lora.rank", "8", "--lora.alpha", "16"]


def _rank(rank: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", POLYTRAIN_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor, distribute_tensor

    from polytrain.config import load_config
    from polytrain.distributed.world import barrier
    from polytrain.inference.generate import generate
    from polytrain.inference.hybrid_engine import HybridEngine
    from polytrain.train.build import build_model
    from polytrain.train.startup import start

    cfg = load_config(None, _overrides(args))
    runtime, _ = start(cfg)
    built = build_model(runtime, cfg)
    with torch.no_grad():  # non-zero adapters, as after some training
        for name, p in built.model.named_parameters():
            if name.endswith(".lora_b") and isinstance(p, DTensor):
                full = 0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
    prompts = _prompts(rank, args.vocab)
    engine = HybridEngine(runtime, cfg, built.model, gather_blocks=1)
    engine.generate(prompts, 2, temperature=0.0)  # warm-up of both paths
    generate(built.model, prompts, 2, temperature=0.0)
    barrier()
    start_s = time.perf_counter()
    with_engine = engine.generate(prompts, args.new_tokens, temperature=0.0)
    engine_s = time.perf_counter() - start_s
    barrier()
    runtime.acc.reset_peak_memory()
    start_s = time.perf_counter()
    without = generate(built.model, prompts, args.new_tokens, temperature=0.0)
    plain_s = time.perf_counter() - start_s
    tokens = sum(len(t) for t in with_engine)
    queue.put((rank, {"engine_tok_s": tokens / engine_s, "no_engine_tok_s": tokens / plain_s,
                      "same_tokens": with_engine == without, "phases": engine.phases,
                      "no_engine_peak_gb": runtime.acc.memory_stats()["peak_gb"]}))


def _trl(args) -> dict:
    """One rank's prompts through TRL's generation path (this process must have trl)."""
    import accelerate
    import peft
    import transformers
    from trl.models.utils import unwrap_model_for_generation

    from polytrain.backend.host_device import peak_rss_bytes, reset_peak_rss

    torch.set_num_threads(1)
    config = transformers.LlamaConfig(hidden_size=args.dim, num_hidden_layers=args.layers, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=args.ffn, vocab_size=args.vocab,
                                      max_position_embeddings=max(PROMPT_LENGTHS) + args.new_tokens,
                                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    accelerator = accelerate.Accelerator(cpu=True)
    model = accelerator.prepare(model)
    prompts = _prompts(args.trl_rank, args.vocab)
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])

    def run(n: int) -> torch.Tensor:
        with unwrap_model_for_generation(model, accelerator) as unwrapped, torch.no_grad():
            return unwrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False)

    run(2)
    reset_peak_rss()
    start = time.perf_counter()
    out = run(args.new_tokens)
    seconds = time.perf_counter() - start
    return {"trl_tok_s": (out.shape[1] - longest) * len(prompts) / seconds, "trl_peak_gb": peak_rss_bytes() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--trl-python", default="", help="a Python with trl installed (skipped when empty)")
    parser.add_argument("--trl", action="store_true", help=argparse.SUPPRESS)  # a TRL child process
    parser.add_argument("--trl-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl:
        print(json.dumps(_trl(args)))
        return
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    trl = {}
    if args.trl_python:  # two processes at once, one rank's prompts each, as the two ranks above run
        passed = [a for a in sys.argv[1:] if not a.startswith("--trl-python") and a != args.trl_python]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        children = [subprocess.Popen([args.trl_python, __file__, *passed, "--trl", "--trl-rank", str(r)],
                                     stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
        outs = [json.loads(child.communicate()[0].strip().splitlines()[-1]) for child in children]
        if any(child.returncode for child in children):
            raise SystemExit("a TRL process failed")
        trl = {"trl_tok_s": sum(o["trl_tok_s"] for o in outs) / 2, "trl_peak_gb": outs[0]["trl_peak_gb"]}
    r0 = ranks[0]
    engine = sum(r["engine_tok_s"] for r in ranks.values()) / 2
    plain = sum(r["no_engine_tok_s"] for r in ranks.values()) / 2
    print(f"Llama dim {args.dim} x {args.layers} blocks, vocab {args.vocab}, LoRA r 8; dp 2 ZeRO-3 on 2 gloo ranks "
          f"(1 thread each); 4 prompts of {PROMPT_LENGTHS} tokens per rank, {args.new_tokens} greedy tokens\n")
    print("| way | tokens/s per rank | vs no engine | peak RSS of the phase (GiB, rank 0) |")
    print("| --- | --- | --- | --- |")
    print(f"| engine (gather {r0['phases']['gather']['s']:.2f} s + generate {r0['phases']['generate']['s']:.2f} s) | "
          f"{engine:.1f} | {engine / plain:.2f}x | gather {r0['phases']['gather']['peak_gb']:.2f}, "
          f"generate {r0['phases']['generate']['peak_gb']:.2f} |")
    print(f"| no engine (through the ZeRO-3 model) | {plain:.1f} | 1.00x | {r0['no_engine_peak_gb']:.2f} |")
    if trl:
        print(f"| TRL unwrap_model_for_generation + generate (PEFT) | {trl['trl_tok_s']:.1f} | "
              f"{trl['trl_tok_s'] / plain:.2f}x | {trl['trl_peak_gb']:.2f} |")
        print(f"\nengine / TRL: {engine / trl['trl_tok_s']:.2f}x tokens/s")
    print(f"engine and no-engine tokens equal on every rank: {all(r['same_tokens'] for r in ranks.values())}")


if __name__ == "__main__":
    main()
