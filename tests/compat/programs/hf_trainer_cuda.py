"""Fine-tune a small Llama with the Hugging Face Trainer, as a script written for a GPU does it:
fp16 mixed precision, pinned-memory data loading, and a CUDA memory report at the end.

The model is built from a config (no download) and learns a synthetic next-token task: each
sequence counts upward modulo the vocabulary from a random start.
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, size, seq_len, vocab):
        generator = torch.Generator().manual_seed(0)
        starts = torch.randint(0, vocab, (size, 1), generator=generator)
        self.tokens = (starts + torch.arange(seq_len)) % vocab

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=12)
    args = parser.parse_args()

    assert torch.cuda.is_available(), "this script needs a GPU"
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8,
        learning_rate=3e-3, warmup_steps=0, logging_steps=1, fp16=True,
        dataloader_pin_memory=True, save_strategy="no", report_to=[], seed=0,
    )
    trainer = Trainer(model=model, args=training_args,
                      train_dataset=CountingDataset(256, 32, config.vocab_size))
    trainer.train()

    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print("losses " + " ".join(f"{loss:.4f}" for loss in losses))
    print(f"device {training_args.device} fp16 {training_args.fp16} "
          f"scaler {trainer.accelerator.scaler is not None} "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB "
          f"({torch.cuda.get_device_name(0)})")


if __name__ == "__main__":
    main()
