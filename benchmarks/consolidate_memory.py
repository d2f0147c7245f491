"""Peak RSS of `polytrain consolidate` vs model size (125m and 350m Llama checkpoints, 1 process / ZeRO-3 x2 / x4).

    PYTHONPATH=. python benchmarks/consolidate_memory.py [WORKDIR]     # ~5.5 min on 2 cores

Writes a single-process and ZeRO-3 2- and 4-rank DCP checkpoints of each size, then runs each
consolidation in a fresh subprocess that reports VmHWM after its imports and at the end.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from polytrain.checkpoint.trainer_state import FORMAT
from polytrain.config import load_config
from polytrain.models import ARCHITECTURES
from polytrain.models.common.init import init_plain
from tests.multirank import run_ranks


def build(size):
    cfg = load_config(None, ["--model.size", size]).model
    model = ARCHITECTURES["llama"].build(cfg)
    init_plain(model, 0)
    return model


def trainer_json(path):
    (path / "trainer.json").write_text(json.dumps({"format": FORMAT, "step": 0, "sampler": {}, "optimizer": "adamw",
                                                   "model_config": {}, "world_size": 1}))


def _save_zero3(rank, world_size, size, path):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(size)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)


CHILD = r"""
import resource, sys, time
def hwm():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024
import torch, torch.distributed.checkpoint as dcp, safetensors.torch
from polytrain.checkpoint.consolidate import consolidate
base = hwm(); t = time.time()
mode, ckpt, out = sys.argv[1:4]
if mode == 'naive':  # for comparison: the whole state dict loaded, then save_file
    md = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items() if k.startswith('model.')}
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    safetensors.torch.save_file(sd, out)
else:
    consolidate(ckpt, out, dtype=sys.argv[4], fmt=mode)
print(f'{base:.0f} {hwm():.0f} {time.time() - t:.1f}')
"""


def main():
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    print("| model | layout | output | model fp32 MiB | largest tensor MiB | RSS after imports MiB | peak RSS MiB | peak - imports MiB | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in ("125m", "350m"):
        model = build(size)
        sd = model.state_dict()
        model_mib = sum(t.numel() * 4 for t in sd.values()) / 2**20
        largest_mib = max(t.numel() * 4 for t in sd.values()) / 2**20
        single, zero3, zero3x4 = (work / f"{size}_{name}" for name in ("single", "zero3x2", "zero3x4"))
        dcp.save({"model": sd}, checkpoint_id=str(single), no_dist=True)
        run_ranks(2, _save_zero3, size, str(zero3))
        run_ranks(4, _save_zero3, size, str(zero3x4))
        for ckpt in (single, zero3, zero3x4):
            trainer_json(ckpt)
        cases = [(single, "safetensors", "fp32"), (zero3, "safetensors", "fp32"), (zero3x4, "safetensors", "fp32"),
                 (zero3, "safetensors", "bf16"), (zero3, "pt", "fp32"), (zero3, "naive", "fp32")]
        for ckpt, mode, dtype in cases:
            out = work / f"out.{'pt' if mode == 'pt' else 'safetensors'}"
            res = subprocess.run([sys.executable, "-c", CHILD, mode, str(ckpt), str(out), dtype],
                                 capture_output=True, text=True, check=True)
            base, peak, secs = res.stdout.split()
            if (mode, dtype) == ("safetensors", "fp32"):  # the file holds exactly the initialized weights
                with safe_open(str(out), "pt") as f:
                    assert sorted(f.keys()) == sorted(sd) and all(torch.equal(f.get_tensor(k), v) for k, v in sd.items())
            layout = {single: "1 process", zero3: "ZeRO-3 x2", zero3x4: "ZeRO-3 x4"}[ckpt]
            what = "naive dcp.load + save_file" if mode == "naive" else f"{mode} {dtype}"
            print(f"| {size} | {layout} | {what} | {model_mib:.0f} | {largest_mib:.0f} | {base} | {peak} | "
                  f"{int(peak) - int(base)} | {secs} |", flush=True)
            out.unlink()


if __name__ == "__main__":
    main()
