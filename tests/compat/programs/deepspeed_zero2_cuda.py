"""A DeepSpeed ZeRO-2 training script written for CUDA GPUs, in the style of DeepSpeed's
examples: the model is moved with .cuda(), batches with .to(local_rank), and steps are timed
around torch.cuda.synchronize(). Run with `deepspeed script.py` (or torchrun) on GPUs."""

import argparse
import time

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

DS_CONFIG = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e5, "allgather_bucket_size": 5e5,
                          "overlap_comm": True, "contiguous_gradients": True},
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
}


class TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.embed(tokens) + self.mlp(self.embed(tokens)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="nccl")
    torch.cuda.set_device(args.local_rank if args.local_rank >= 0 else 0)
    torch.manual_seed(0)
    model = TinyLM().cuda()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=DS_CONFIG)
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(rank)  # each rank its own data shard
    pattern = torch.arange(64).repeat(8)  # a learnable sequence: next token = token + 1

    for step in range(args.steps):
        torch.cuda.synchronize()
        start = time.time()
        for _ in range(engine.gradient_accumulation_steps()):
            offsets = torch.randint(0, 64, (engine.train_micro_batch_size_per_gpu(),),
                                    generator=generator)
            batch = torch.stack([pattern[o:o + 17] for o in offsets]).to(engine.local_rank)
            logits = engine(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 64), batch[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} time {time.time() - start:.3f}s", flush=True)

    params = sum(p.float().sum().item() for p in engine.module.parameters())
    print(f"rank {rank} zero_stage {engine.zero_optimization_stage()} "
          f"accelerator {deepspeed.get_accelerator().device_name()} "
          f"backend {torch.distributed.get_backend()} params {params:.6f}", flush=True)


if __name__ == "__main__":
    main()
