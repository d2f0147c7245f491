"""examples/slurm and examples/kubernetes start `python -m polytrain.train` under torchrun's c10d
rendezvous with the right node count, workers per node, rendezvous address and id, the config
and a shared run directory. Slurm's script runs with fake SLURM_* variables and stub `scontrol`,
`srun` and `torchrun` that record what they were given; the manifest is read as YAML."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from polytrain.config import load_config
from polytrain.train.__main__ import config_from_argv

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
MANIFEST = ROOT / "examples" / "kubernetes" / "pytorchjob.yaml"

STUBS = {
    # scontrol show hostnames gpu[07-08]: what Slurm's expansion of the node list prints
    "scontrol": 'echo "$*" > "$RECORD/scontrol.args"; printf "gpu07\\ngpu08\\n"',
    # srun OPTIONS COMMAND...: record, then run the command as srun would on each node
    "srun": 'printf "%s\\n" "$@" > "$RECORD/srun.args"; while [[ $1 == -* ]]; do shift; done; exec "$@"',
    "torchrun": 'printf "%s\\n" "$@" > "$RECORD/torchrun.args"; env > "$RECORD/torchrun.env"',
}


def _run_sbatch(tmp_path: Path, *overrides: str) -> tuple[list[str], list[str], dict[str, str]]:
    stubs, record = tmp_path / "bin", tmp_path / "record"
    stubs.mkdir()
    record.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM_", "MASTER_", "OMP_", "CONFIG", "RUN_DIR", "GPUS_PER_NODE"))}
    env |= {"PATH": f"{stubs}:{env['PATH']}", "RECORD": str(record), "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "polytrain", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "32",
            "CONFIG": str(ROOT / "configs" / "llama_small_zero3.toml"), "RUN_DIR": "/shared/runs/zero3"}
    subprocess.run(["bash", str(SBATCH), *overrides], env=env, cwd=tmp_path, check=True, timeout=60)
    torchrun_env = dict(line.split("=", 1) for line in (record / "torchrun.env").read_text().splitlines()
                        if "=" in line)
    assert (record / "scontrol.args").read_text().split() == ["show", "hostnames", "gpu[07-08]"]
    return ((record / "srun.args").read_text().splitlines(), (record / "torchrun.args").read_text().splitlines(),
            torchrun_env)


def test_slurm_script_starts_torchrun_on_every_node_with_c10d_rendezvous(tmp_path):
    srun, torchrun, env = _run_sbatch(tmp_path, "--train.lr", "1e-4")
    assert "--kill-on-bad-exit=1" in srun and "--ntasks-per-node=1" in srun
    assert srun[srun.index("torchrun") + 1:] == torchrun  # srun runs torchrun once per node
    config = str(ROOT / "configs" / "llama_small_zero3.toml")
    assert torchrun == [
        "--nnodes", "2", "--nproc-per-node", "4",  # SLURM_NNODES; a worker per GPU of the node
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu07:29500",  # the first node of the list
        "--rdzv-id", "4242", "--max-restarts", "3",  # the job id: one rendezvous per job
        "-m", "polytrain.train", "--config", config, "--run.out_dir", "/shared/runs/zero3", "--train.lr", "1e-4",
    ]
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["OMP_NUM_THREADS"]) == ("gpu07", "29500", "8")
    cfg = config_from_argv(torchrun[torchrun.index("polytrain.train") + 1:])  # what each worker reads
    assert (str(cfg.run_dir), cfg.train.lr, cfg.parallel.zero) == ("/shared/runs/zero3", 1e-4, 3)


def _manifest():
    yaml = pytest.importorskip("yaml", reason="PyYAML is absent (the test extra brings it)")
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    return {doc["kind"]: doc for doc in docs}


def _options(command: list[str]) -> dict[str, str]:
    """torchrun's `--name value` pairs before -m."""
    head = command[1:command.index("-m")]
    return dict(zip(head[::2], head[1::2]))


def test_pytorchjob_runs_torchrun_with_c10d_rendezvous_on_every_pod(tmp_path):
    docs = _manifest()
    job, config_map = docs["PyTorchJob"], docs["ConfigMap"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    pods = [replicas["Master"]["template"]["spec"], replicas["Worker"]["template"]["spec"]]
    assert pods[0] == pods[1]  # every pod runs the same torchrun
    (container,) = pods[0]["containers"]
    assert container["name"] == "pytorch"  # the container the training operator configures
    command = container["command"]
    options = _options(command)
    assert command[0] == "torchrun" and command[command.index("-m") + 1] == "polytrain.train"
    assert int(options["--nnodes"]) == replicas["Master"]["replicas"] + replicas["Worker"]["replicas"]
    assert int(options["--nproc-per-node"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    assert options["--rdzv-backend"] == "c10d"
    assert options["--rdzv-endpoint"] == "$(MASTER_ADDR):$(MASTER_PORT)"  # the operator's Master service
    rdzv_env = options["--rdzv-id"].removeprefix("$(").removesuffix(")")
    assert rdzv_env in {e["name"] for e in container["env"]}
    assert int(options["--max-restarts"]) > 0

    args = command[command.index("polytrain.train") + 1:]
    flags = dict(zip(args[::2], args[1::2]))
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pods[0]["volumes"]}
    config_dir, config_file = flags["--config"].rsplit("/", 1)
    (config_volume,) = [name for name, path in mounts.items() if path == config_dir]
    assert volumes[config_volume]["configMap"]["name"] == config_map["metadata"]["name"]
    (shared,) = [name for name, path in mounts.items() if flags["--run.out_dir"].startswith(path + "/")]
    assert "persistentVolumeClaim" in volumes[shared]  # the run directory outlives the pods

    (tmp_path / config_file).write_text(config_map["data"][config_file])
    cfg = load_config(tmp_path / config_file, args[2:])  # the mounted config loads, with the overrides
    assert str(cfg.run_dir) == "/shared/runs/llama-1b" and cfg.data.source.startswith("/shared/")
    world = int(options["--nnodes"]) * int(options["--nproc-per-node"])
    assert cfg.train.global_batch_size % (cfg.train.micro_batch_size * world) == 0
