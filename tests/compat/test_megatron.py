"""A Megatron-Core GPT training loop written for CUDA and NCCL runs unmodified with tensor
parallelism over two CPU ranks under `polytrain run --nproc 2`, in fp32 and in Megatron's bf16
(Float16Module and its mixed-precision optimizer, which sorts parameters by their
"torch.cuda.*Tensor" type names)."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="the compat test extra installs megatron-core")

SCRIPT = Path(__file__).parent / "programs" / "megatron_gpt_cuda.py"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_tensor_parallel_gpt_trains_on_two_cpu_ranks(bf16):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "run", "--nproc", "2", str(SCRIPT),
                           "--iters", "12", *(["--bf16"] if bf16 else [])],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = {rank: [float(x) for x in
                     re.findall(rf"rank {rank} iteration \d+ loss (\d+\.\d{{5}})", proc.stdout)]
              for rank in (0, 1)}
    assert len(losses[0]) == 12 and all(math.isfinite(x) for x in losses[0])
    assert losses[0] == losses[1]  # tensor-parallel ranks compute one loss together
    assert max(losses[0][-3:]) < min(losses[0][:3]) - 0.5, losses[0]
    # Each rank holds half of the first MLP layer (ffn 4 * 64 = 256 rows): tensor parallelism
    # really split the model, and its collectives ran over gloo.
    shards = re.findall(r"rank \d tp (\d) fc1_shard \((\d+), (\d+)\) backend (\w+) dtypes (\S+) (\S+)",
                        proc.stdout)
    # bf16: 16-bit weights, fp32 main parameters in Megatron's optimizer.
    dtypes = ("torch.bfloat16", "torch.float32") if bf16 else ("torch.float32", "torch.float32")
    assert shards == [("2", "128", "64", "gloo", *dtypes)] * 2
