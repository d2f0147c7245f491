"""Run code written for CUDA, unchanged, on the active accelerator.

    polytrain run [--nproc N] SCRIPT [ARGS...]      # N workers, like torchrun (none: this process)
    python -m polytrain.compat SCRIPT [ARGS...]     # in a process torchrun started
    python -m polytrain.compat -m MODULE [ARGS...]
    import polytrain.compat.auto                    # as a script's first line

The shim itself lives in polytrain.backend.compat, the one package allowed to name CUDA;
docs/COMPAT.md says what it maps, what it cannot, and its is_available() policy.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from polytrain.backend.compat import CompatError, Shim, active, install, uninstall
from polytrain.errors import PolytrainError


def run_program(argv: list[str]) -> None:
    """Install the shim, then run `SCRIPT ARGS...` or `-m MODULE ARGS...` as `python` would:
    as __main__, with sys.argv and sys.path[0] set the same way."""
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise PolytrainError("name a script to run (SCRIPT [ARGS...] or -m MODULE [ARGS...])")
    if argv[0] != "-m" and not Path(argv[0]).is_file():
        raise PolytrainError(f"no such script: {argv[0]}")
    shim = install()
    if shim is not None and os.environ.get("RANK", "0") == "0":
        print(shim.describe(), file=sys.stderr, flush=True)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in argv[0]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)  # `python SCRIPT` puts its folder first
        runpy.run_path(argv[0], run_name="__main__")


__all__ = ["CompatError", "Shim", "active", "install", "run_program", "uninstall"]
