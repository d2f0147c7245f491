"""A single-file GPT trainer in the style of nanoGPT's train.py, written for a CUDA GPU.

Character-level language model on the source of the standard library's json.decoder. Config
values are module globals that `--key=value` arguments override, as nanoGPT's configurator does.
The test runs this file unmodified under `polytrain run`, and a copy hand-edited for the CPU.
"""

import inspect
import json.decoder
import math
import os
import sys
from ast import literal_eval
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
# config
batch_size = 8
block_size = 32
n_layer = 2
n_head = 2
n_embd = 64
dropout = 0.0
learning_rate = 3e-3
max_iters = 20
weight_decay = 0.1
grad_clip = 1.0
device = 'cuda'
compile = True  # use PyTorch 2.0 to compile the model to be faster
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float16'
for arg in sys.argv[1:]:  # nanoGPT's configurator: --key=value overrides a global
    key, val = arg[2:].split('=')
    try:
        val = literal_eval(val)
    except (SyntaxError, ValueError):
        pass  # a string
    assert type(val) == type(globals()[key]), f"--{key}: expected {type(globals()[key]).__name__}"
    globals()[key] = val
# -----------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith('c_proj.weight') else 0.02
                torch.nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    init_process_group(backend='nccl')
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    device = f'cuda:{ddp_local_rank}'
    torch.cuda.set_device(device)
    master_process = int(os.environ['RANK']) == 0
else:
    master_process = True
torch.manual_seed(1337)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

text = inspect.getsource(json.decoder)
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    if device_type == 'cuda':
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


model = GPT(len(chars))
model.to(device)
scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))
use_fused = 'fused' in inspect.signature(torch.optim.AdamW).parameters and device_type == 'cuda'
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay,
                              fused=use_fused)
if compile:
    print("compiling the model... (takes a ~minute)")
    model = torch.compile(model)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])

X, Y = get_batch()
for iter_num in range(max_iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with ctx:
        logits, loss = model(X, Y)
    X, Y = get_batch()  # prefetch the next batch while the GPU works
    scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    end.record()
    torch.cuda.synchronize()
    dt = start.elapsed_time(end)
    if master_process:
        mem = torch.cuda.max_memory_allocated() / 2**20
        print(f"iter {iter_num}: loss {loss.item():.6f}, time {dt:.2f}ms, mem {mem:.0f}MiB, dtype {dtype}")
if ddp:
    destroy_process_group()
