"""A CUDA function compiled whole (fullgraph=True): device names, .cuda(), current_device(),
autocast("cuda"). Prints its graph count and breaks as Dynamo explains them, as JSON."""

import json

import torch
import torch._dynamo


def step(x):
    y = torch.zeros(3, device="cuda") + x.cuda() + x.to(torch.cuda.current_device())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        z = y.view(1, 3) @ torch.ones(3, 3, device=torch.device("cuda", 0))
    return z.float().sum() + torch.arange(3, device="cuda:0").sum()


explained = torch._dynamo.explain(step)(torch.ones(3))
compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
print(json.dumps({"graphs": explained.graph_count, "breaks": explained.graph_break_count,
                  "reasons": [r.reason.splitlines()[0] for r in explained.break_reasons],
                  "equal": bool(torch.equal(compiled(torch.ones(3)), step(torch.ones(3))))}))
