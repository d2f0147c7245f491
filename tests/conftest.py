"""Shared fixtures: an isolated cache, a small deterministic corpus, a tiny model config.

`pytest --compat-shim` runs the suite with polytrain's CUDA shim installed, as `polytrain run`
would install it, in this process and in the ranks tests spawn (tests/multirank.py):
polytrain must keep working under it. tests/compat, which installs and removes the shim
itself, is left out then.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

SHIM_ENV = "POLYTRAIN_TEST_COMPAT_SHIM"


def pytest_addoption(parser):
    parser.addoption("--compat-shim", action="store_true",
                     help="run the tests with polytrain's CUDA shim installed")


def pytest_configure(config):
    # NCCL's rules checked on gloo in every rank the tests start (tests/multirank.py, and the
    # `polytrain train` workers through init_world): docs/ARCHITECTURE.md, "Strict collectives"
    os.environ.setdefault("POLYTRAIN_STRICT_COLLECTIVES", "1")
    if config.getoption("--compat-shim") or os.environ.get(SHIM_ENV) == "1":
        os.environ[SHIM_ENV] = "1"  # spawned ranks install it too
        os.environ.setdefault("POLYTRAIN_ACCELERATOR", "cpu")
        from polytrain.backend.compat import install

        install()


def pytest_terminal_summary(terminalreporter):
    from polytrain.backend.compat import active

    if os.environ.get(SHIM_ENV) == "1":  # tests/compat/test_suite_under_shim.py reads this
        shim = active()
        terminalreporter.write_line(shim.describe() if shim else "polytrain compat: not installed")


def pytest_ignore_collect(collection_path, config):
    if os.environ.get(SHIM_ENV) == "1" and collection_path.name == "compat" \
            and collection_path.parent.name == "tests":
        return True
    return None


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory) -> Path:
    """Tokenizers and token files of this test session live in a fresh directory.

    Set in os.environ so spawned ranks and subprocesses inherit it.
    """
    cache = tmp_path_factory.mktemp("polytrain-cache")
    os.environ["POLYTRAIN_CACHE"] = str(cache)
    # torch.compile's kernels: one cache for the session's processes (ranks reuse what the
    # first compiled), nothing from earlier sessions, so a test's compile cost is CI's.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor-cache"))
    os.environ.setdefault("POLYTRAIN_ACCELERATOR", "cpu")
    return cache


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """~400 KB of Python source from a fixed set of stdlib packages, as one .jsonl corpus."""
    import json

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py"))
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    with path.open("w") as f:
        for file in files:
            f.write(json.dumps({"text": file.read_text(encoding="utf-8", errors="replace")}) + "\n")
    return path


def tiny_overrides(corpus: Path, run_dir: Path, **extra) -> list[str]:
    """Command-line overrides for a seconds-long run of a ~100K-parameter model."""
    values = {
        "data.source": str(corpus), "data.seq_len": 64, "data.val_fraction": 0.1,
        "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.ffn_dim": 128, "model.vocab_size": 512,
        "train.micro_batch_size": 2, "train.global_batch_size": 8, "train.lr": 3e-3,
        "train.warmup_steps": 2, "run.steps": 10, "run.log_every": 1, "run.eval_every": 0,
        "run.eval_batches": 2, "run.sample_tokens": 0, "run.out_dir": str(run_dir), "run.seed": 7,
    }
    values.update({k.replace("__", "."): v for k, v in extra.items()})
    args = []
    for key, value in values.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args
