"""A DeepSpeed-style training script running on polytrain: the only change is `import polytrain`.

    python examples/deepspeed_style/train.py                       # one process, ds_config.json here
    torchrun --nproc_per_node 2 examples/deepspeed_style/train.py --deepspeed_config ds_config.json

The model is a small Llama (polytrain's "tiny" shape, scaled down) whose forward returns its
loss, as the models in DeepSpeed's examples do. The data goes through polytrain's pipeline (a
cached byte-level BPE over the corpus, packed token files, the global-batch sampler), so with
the same seed and batch size the batches are exactly those `polytrain train` reads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import polytrain
from polytrain.config import DataConfig, ModelConfig
from polytrain.data import GlobalBatchSampler, TokenDataset, prepare_corpus
from polytrain.distributed.world import barrier, mean_over_world
from polytrain.models.common.init import init_plain
from polytrain.models.llama.model import Llama
from polytrain.train.worker_exit import run_and_exit

HERE = Path(__file__).resolve().parent
MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 512}


class LlamaLM(Llama):
    """A Llama whose forward(inputs, targets) returns the mean next-token cross-entropy."""

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = super().forward(inputs)  # (B, T, vocab)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="set by DeepSpeed-style launchers (torchrun sets LOCAL_RANK instead)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--data", default="stdlib",
                        help="'stdlib' (this Python's sources), a .txt or .jsonl file, or a directory")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--val_fraction", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=1234, help="weights and data order")
    parser.add_argument("--save_dir", default=None, help="save a checkpoint there at the end")
    polytrain.add_config_arguments(parser)
    args = parser.parse_args(argv)
    args.deepspeed_config = args.deepspeed_config or str(HERE / "ds_config.json")
    return args


def load_tokens(args: argparse.Namespace, rank: int) -> TokenDataset:
    """The training token file; rank 0 tokenizes (once, then cached) while the others wait."""
    data_cfg = DataConfig(source=args.data, seq_len=args.seq_len, val_fraction=args.val_fraction)
    if rank == 0:
        prepare_corpus(data_cfg, MODEL["vocab_size"])
    barrier()
    corpus = prepare_corpus(data_cfg, MODEL["vocab_size"])
    return TokenDataset(corpus.train_path, corpus.dtype, args.seq_len)


def main(argv: list[str] | None = None) -> list[dict]:
    """Train; returns one row per optimizer step: step, loss (mean over all ranks), lr, grad_norm."""
    args = parse_args(argv)
    world = polytrain.init_distributed()
    data = load_tokens(args, world.rank)
    model = LlamaLM(ModelConfig(**MODEL, max_seq_len=args.seq_len))
    init_plain(model, args.seed)

    engine, _, _, _ = polytrain.initialize(args=args, model=model, model_parameters=model.parameters())

    sampler = GlobalBatchSampler(len(data), engine.train_batch_size(), args.seed,
                                 engine.global_rank, engine.world_size)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    rows = []
    for _ in range(args.steps):
        indices = sampler.next_batch()  # this rank's share of the step's global batch
        step_loss = 0.0
        for i in range(0, len(indices), micro):
            inputs, targets = data.get_batch(indices[i:i + micro])
            loss = engine(inputs.to(engine.device), targets.to(engine.device))
            engine.backward(loss)
            lr = engine.get_lr()[0]  # the rate this optimizer step runs at
            engine.step()
            step_loss += loss.item() / accum
        rows.append({"step": engine.global_steps, "loss": step_loss, "lr": lr,
                     "grad_norm": engine.get_global_grad_norm()})

    # Each rank saw its own share of every batch; the mean over ranks is the global batch's loss.
    losses = mean_over_world(torch.tensor([r["loss"] for r in rows], dtype=torch.float64,
                                          device=engine.device))
    for row, loss in zip(rows, losses.tolist()):
        row["loss"] = loss
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, client_state={"sampler": sampler.state_dict()})
    if engine.global_rank == 0 and rows:
        print(f"trained {len(rows)} steps on {engine.world_size} rank(s): "
              f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}", flush=True)
    engine.destroy()
    return rows


def _exit_code() -> int:
    main()
    return 0


if __name__ == "__main__":
    # End as polytrain's own workers do: exit handlers and the process group first, then out past
    # the interpreter teardown where gloo's threads can abort a finished multi-rank job.
    run_and_exit(_exit_code)
