"""The nanoGPT-style trainer ported to the CPU by hand, as a person would, keeping its numerics.

tests/compat/test_nanogpt.py compares its losses with the unmodified script's under the shim, and
benchmarks/compat_overhead.py their speed.
"""

from pathlib import Path

SCRIPT = Path(__file__).parent / "nanogpt_cuda.py"

# What a person changes to port the script to the CPU by hand, keeping its numerics: each
# (old, new) must occur exactly once, so the test fails if the script drifts from its port.
CPU_EDITS = [
    ("import inspect\n", "import inspect\nimport resource\nimport time\n"),
    ("device = 'cuda'\n", "device = 'cpu'\n"),
    ("dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float16'",
     "dtype = 'bfloat16'  # every CPU autocasts to bf16"),
    ("init_process_group(backend='nccl')", "init_process_group(backend='gloo')"),
    ("device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n", "device = 'cpu'\n"),
    ("and device_type == 'cuda'\n", "\n"),  # keep the fused AdamW: the CPU has one too
    ("ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(",
     "ctx = torch.amp.autocast("),
    ("torch.cuda.amp.GradScaler(enabled=", "torch.amp.GradScaler('cpu', enabled="),
    ("DDP(model, device_ids=[ddp_local_rank])", "DDP(model)"),
    ("    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)\n"
     "    start.record()\n", "    t0 = time.perf_counter()\n"),
    ("    end.record()\n    torch.cuda.synchronize()\n    dt = start.elapsed_time(end)\n",
     "    dt = (time.perf_counter() - t0) * 1000\n"),
    ("torch.cuda.max_memory_allocated() / 2**20",
     "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10"),
]


def port_to_cpu(text: str) -> str:
    """The script's text with CPU_EDITS applied; fails if an edit no longer applies."""
    for old, new in CPU_EDITS:
        if text.count(old) != 1:
            raise ValueError(f"the CPU port's edit no longer applies: {old!r}")
        text = text.replace(old, new)
    if "torch.cuda." in text:
        raise ValueError("the CPU port is incomplete: it still names torch.cuda")
    return text
