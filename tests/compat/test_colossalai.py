"""Colossal-AI 0.5.0, in an environment of its own (it pins torch <= 2.5.1 and transformers
4.51): a Booster program written for GPUs trains a Hugging Face Llama on two CPU ranks under
`polytrain run --nproc 2`, with HybridParallelPlugin (tensor parallel 2) and LowLevelZeroPlugin
(ZeRO-2). Colossal-AI takes its CUDA path (its CudaAccelerator); the shim is what carries it."""

import re
from pathlib import Path

import pytest

from tests.compat.peers import peer_python, polytrain_run

SCRIPT = Path(__file__).parent / "programs" / "colossalai_llama_cuda.py"


@pytest.mark.parametrize("plugin, q_rows", [("hybrid_parallel", 32), ("low_level_zero", 64)])
def test_booster_trains_a_llama_on_two_cpu_ranks(plugin, q_rows):
    python = peer_python("colossalai")
    proc = polytrain_run(python, ["--nproc", "2", str(SCRIPT), "--plugin", plugin, "--steps", "10"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Two ranks share the pipe: match lines anywhere, not only from a line's start.
    losses = [float(x) for x in re.findall(r"step \d+ loss (\d+\.\d{4})", proc.stdout)]
    assert len(losses) == 10 and max(losses[-3:]) < min(losses[:3]) - 0.3, losses
    ranks = sorted(re.findall(r"rank (\d) plugin (\w+) q_proj \((\d+), 64\) backend (\w+) "
                              r"accelerator (\w+)", proc.stdout))
    # Tensor parallelism splits the 64 rows of q_proj over the two ranks; ZeRO keeps them whole.
    assert ranks == [(str(r), plugin, str(q_rows), "gloo", "CudaAccelerator") for r in (0, 1)]
