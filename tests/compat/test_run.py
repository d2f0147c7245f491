"""`polytrain run`, `python -m polytrain.compat` and `import polytrain.compat.auto` on
unmodified CUDA programs, and their one-line errors."""

import json
import re
import subprocess
import sys
from pathlib import Path

PROGRAMS = Path(__file__).parent / "programs"


def polytrain(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polytrain.cli", *argv], capture_output=True,
                          text=True, timeout=timeout)


def test_run_in_this_process_passes_the_arguments_on():
    proc = polytrain("run", str(PROGRAMS / "cuda_basics.py"), "--lr", "3", "-x")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"argv": ["--lr", "3", "-x"], "available": True, "device": "cpu",
                    "autocast_dtype": "torch.float16", "count": 1}
    assert "torch.cuda -> cpu" in proc.stderr and "nccl -> gloo" in proc.stderr


def test_two_workers_run_ddp_over_nccl_on_gloo():
    proc = polytrain("run", "--nproc", "2", str(PROGRAMS / "ddp_cuda.py"))
    assert proc.returncode == 0, proc.stderr
    lines = sorted(re.findall(r"rank (\d) device (\d) sum (\d+) params (-?\d+\.\d{6})", proc.stdout))
    assert [line[:3] for line in lines] == [("0", "0", "3"), ("1", "1", "3")]
    assert lines[0][3] == lines[1][3]  # DDP averaged the gradients: identical replicas
    assert proc.stderr.count("torch.cuda -> cpu") == 1  # rank 0 says it, once


def test_module_form_and_auto_import(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "polytrain.compat", str(PROGRAMS / "cuda_basics.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1])["device"] == "cpu"
    (tmp_path / "in.json").write_text('{"b": 1, "a": [2]}')
    proc = polytrain("run", "-m", "json.tool", "--sort-keys", "--compact", str(tmp_path / "in.json"))
    assert proc.returncode == 0 and proc.stdout.strip() == '{"a":[2],"b":1}', proc.stderr
    proc = subprocess.run([sys.executable, str(PROGRAMS / "auto_cuda.py")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "auto cpu True"


def test_an_unmappable_call_is_one_line_naming_it_and_where():
    proc = polytrain("run", str(PROGRAMS / "cuda_basics.py"), "--graph")
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: torch.cuda.CUDAGraph cannot run on cpu")
    assert error.endswith("cuda_basics.py:10)")
    assert "Traceback" not in proc.stderr


def test_usage_errors_are_one_line():
    for argv, message in [
        (["run", "no_such_script.py"], "error: no such script: no_such_script.py"),
        (["run", "--nproc", "2", "no_such_script.py"], "error: no such script: no_such_script.py"),
        (["run", "--procs", "2", "x.py"], "error: polytrain run: unknown option --procs"),
        (["run", "--nproc", "zero", "x.py"], "error: polytrain run: --nproc needs a positive number"),
        (["run"], "error: polytrain run: name the program"),
    ]:
        proc = polytrain(*argv)
        assert proc.returncode == 2 and proc.stderr.startswith(message), (argv, proc.stderr)
