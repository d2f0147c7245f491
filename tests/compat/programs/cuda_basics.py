"""A single-process CUDA script: prints what it sees as JSON; --graph makes an unmappable call."""

import json
import sys

import torch

assert __name__ == "__main__"
if "--graph" in sys.argv:
    graph = torch.cuda.CUDAGraph()
x = torch.randn(16, 16, device="cuda")
with torch.autocast("cuda"):
    y = x @ x
print(json.dumps({
    "argv": sys.argv[1:], "available": torch.cuda.is_available(), "device": str(x.device),
    "autocast_dtype": str(y.dtype), "count": torch.cuda.device_count(),
}))
