"""A Megatron-Core GPT training loop written for CUDA and NCCL, after Megatron-LM's
examples/run_simple_mcore_train_loop.py: tensor parallel over the ranks torchrun starts.
Run with `torchrun --nproc-per-node 2 megatron_gpt_cuda.py` on two GPUs. `--bf16` trains as
Megatron-LM does in bf16: the model in Float16Module, Megatron's mixed-precision optimizer
(fp32 main parameters) with gradient clipping."""

import argparse
import os
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ_LEN, MICRO_BATCH, VOCAB = 32, 4, 128


def initialize_distributed(tensor_model_parallel_size):
    parallel_state.destroy_model_parallel()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group(backend="nccl", rank=int(os.environ["RANK"]),
                                         world_size=int(os.environ["WORLD_SIZE"]))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size)


def model_provider(bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, bf16=bf16,
                               params_dtype=dtype, use_cpu_initialization=True, pipeline_dtype=dtype)
    return config, GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                            vocab_size=VOCAB, max_sequence_length=SEQ_LEN)


def batches():
    """Mock data in the spirit of Megatron's MockGPTDataset: sequences that count up by one,
    from a seeded start, so the next token is learnable."""
    generator = torch.Generator().manual_seed(1234)
    while True:
        start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=generator)
        tokens = (start + torch.arange(SEQ_LEN + 1)) % VOCAB
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
               "position_ids": torch.arange(SEQ_LEN).expand(MICRO_BATCH, SEQ_LEN),
               "attention_mask": torch.ones(1, 1, SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril().logical_not(),
               "loss_mask": torch.ones(MICRO_BATCH, SEQ_LEN)}


def forward_step_func(data_iterator, model):
    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        return loss, {"lm loss": loss}

    data = next(data_iterator)
    device = torch.cuda.current_device()
    tokens, labels = data["tokens"].to(device), data["labels"].to(device)
    output_tensor = model(tokens, data["position_ids"].to(device),
                          data["attention_mask"].to(device), labels=labels)
    return output_tensor, partial(loss_func, data["loss_mask"].to(device))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()

    initialize_distributed(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(123)
    config, gpt_model = model_provider(args.bf16)
    gpt_model.cuda(torch.cuda.current_device())
    model = Float16Module(config, gpt_model) if args.bf16 else gpt_model
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    if args.bf16:
        optim = Float16OptimizerWithFloat16Params(
            optim, OptimizerConfig(lr=3e-3, bf16=True, clip_grad=1.0), grad_scaler=None, init_state_fn=None)
    forward_backward_func = get_forward_backward_func()
    data_iterator = iter(batches())

    for iteration in range(args.iters):
        optim.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=1, seq_length=SEQ_LEN, micro_batch_size=MICRO_BATCH,
            decoder_seq_length=SEQ_LEN, forward_only=False)
        optim.step()
        rank = torch.distributed.get_rank()
        print(f"rank {rank} iteration {iteration} loss {losses_reduced[0]['lm loss'].item():.5f}",
              flush=True)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    weight = gpt_model.decoder.layers[0].mlp.linear_fc1.weight
    main = getattr(weight, "main_param", weight)  # the optimizer's fp32 copy in bf16
    print(f"rank {torch.distributed.get_rank()} tp {tp} fc1_shard {tuple(weight.shape)} "
          f"backend {torch.distributed.get_backend()} dtypes {weight.dtype} {main.dtype}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
