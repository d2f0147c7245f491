"""`python -m polytrain.compat SCRIPT [ARGS...]` (or `-m MODULE [ARGS...]`): run one CUDA-written
program on the active accelerator. `polytrain run --nproc N` starts N of these."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from polytrain.compat import run_program
from polytrain.errors import CompatError, PolytrainError
from polytrain.train.launch import EXIT_USER_ERROR
from polytrain.train.worker_exit import run_and_exit

_POLYTRAIN = Path(__file__).resolve().parents[1]


def _where(error: BaseException) -> str:
    """' (at FILE:LINE)' of the program's own line that made the call, if there is one."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not Path(f.filename).resolve().is_relative_to(_POLYTRAIN)
              and "runpy" not in Path(f.filename).name]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def main(argv: list[str]) -> int:
    try:
        run_program(argv)
    except CompatError as e:  # an unmappable CUDA call: name it and where the program made it
        print(f"error: {e}{_where(e)}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except PolytrainError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    run_and_exit(lambda: main(sys.argv[1:]))
