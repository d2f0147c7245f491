"""Train a Hugging Face Llama with Colossal-AI's Booster on GPUs, in the style of Colossal-AI's
examples (examples/language/llama): `colossalai.launch_from_torch()`, a plugin chosen with
--plugin, `booster.boost(...)`, `booster.backward(loss, optimizer)`, batches moved with
`.cuda()`. Run with `colossalai run --nproc_per_node 2 script.py` (or torchrun) on 2 GPUs.

--plugin hybrid_parallel: tensor parallelism over 2 GPUs (shardformer splits attention and
MLP), fp16 with dynamic loss scaling. --plugin low_level_zero: ZeRO stage 2 over 2 GPUs, fp16.
The model is built from a config; the data is a synthetic counting task.
"""

import argparse

import colossalai
import torch
import torch.distributed as dist
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin
from colossalai.cluster import DistCoordinator
from transformers import LlamaConfig, LlamaForCausalLM


def counting_batches(steps, batch_size, seq_len, vocab, seed):
    """Each sequence counts upward modulo the vocabulary from a random start."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, vocab, (batch_size, 1), generator=generator)
        tokens = (starts + torch.arange(seq_len)) % vocab
        yield {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--plugin", choices=["hybrid_parallel", "low_level_zero"],
                        default="hybrid_parallel")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=4)
    args = parser.parse_args()

    colossalai.launch_from_torch(seed=42)
    coordinator = DistCoordinator()
    if args.plugin == "hybrid_parallel":
        plugin = HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=0, precision="fp16",
                                      initial_scale=2**10)
    else:
        plugin = LowLevelZeroPlugin(stage=2, precision="fp16", initial_scale=2**10)
    booster = Booster(plugin=plugin)

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64, pad_token_id=0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, _, _, _ = booster.boost(model, optimizer)

    # Under tensor parallelism both ranks see the same batch; under ZeRO each its own shard.
    seed = 0 if args.plugin == "hybrid_parallel" else dist.get_rank()
    for step, batch in enumerate(counting_batches(args.steps, args.batch_size, 32,
                                                  config.vocab_size, seed)):
        batch = {k: v.cuda() for k, v in batch.items()}
        loss = model(**batch).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        coordinator.print_on_master(f"step {step} loss {loss.item():.4f}")

    # What tensor parallelism split: the first layer's q projection, per rank.
    q_proj = model.unwrap().model.layers[0].self_attn.q_proj.weight
    print(f"rank {dist.get_rank()} plugin {args.plugin} q_proj {tuple(q_proj.shape)} "
          f"backend {dist.get_backend()} accelerator "
          f"{type(colossalai.accelerator.get_accelerator()).__name__} "
          f"peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
