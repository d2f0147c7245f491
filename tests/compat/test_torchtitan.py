"""torchtitan 0.3.0 (with triton), in an environment of its own: its trainer, unmodified, trains
the llama3 debug model with FSDP over two CPU ranks under `polytrain run --nproc 2`, on a
tokenizer and a c4_test data set made here (programs/torchtitan_assets.py). torchtitan sees
CUDA (`torch.cuda.is_available()`), sets its devices through torch.cuda, runs NCCL collectives
with their PREMUL_SUM reduce op, and compiles its flex-attention masks with inductor."""

import re
import subprocess
from pathlib import Path

from tests.compat.peers import peer_python, polytrain_run

PROGRAMS = Path(__file__).parent / "programs"
STEP = re.compile(r"step:\s+(\d+)\s+(?:\x1b\[\d+m)?loss:\s+(\d+\.\d+)")


def test_llama3_debug_model_trains_with_fsdp_on_two_cpu_ranks(tmp_path):
    python = peer_python("torchtitan")
    subprocess.run([python, str(PROGRAMS / "torchtitan_assets.py"), str(tmp_path)], check=True,
                   timeout=300)
    proc = polytrain_run(python, [
        "--nproc", "2", "-m", "torchtitan.train",
        "--module", "tests.compat.programs.torchtitan_configs", "--config", "llama3_debugmodel_cpu",
        "--training.steps", "10", "--training.seq_len", "128", "--training.local_batch_size", "2",
        "--debug.seed", "0", "--checkpoint.no-enable",
        "--parallelism.data_parallel_shard_degree", "2",
    ], cwd=tmp_path)
    output = proc.stdout + proc.stderr  # torchtitan logs to stderr
    assert proc.returncode == 0, output[-4000:]
    losses = {}
    for step, loss in STEP.findall(re.sub(r"\x1b\[[0-9;]*m", "", output)):
        losses.setdefault(int(step), []).append(float(loss))
    assert sorted(losses) == list(range(1, 11)), output[-3000:]
    # Both ranks log the same (all-reduced) loss each step, and it falls.
    assert all(len(set(per_rank)) == 1 and len(per_rank) == 2 for per_rank in losses.values())
    curve = [losses[step][0] for step in range(1, 11)]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.2, curve
    assert "fsdp" in output and "Training starts at step 1" in output
