"""Which RLHF steps run, where each writes, and whether the ones a step needs are finished.

    runs/<name>/sft/       step 1: the SFT actor (an ordinary run directory)
    runs/<name>/reward/    step 2: the reward model
    runs/<name>/ppo/       step 3: the final actor (PPO or GRPO), what `polytrain chat runs/<name>` talks to

A step is finished when its directory holds `complete.json`, written last, after its
final checkpoint; a finished step is skipped, an unfinished one resumes from its newest
checkpoint. Step 2 starts from step 1's actor, step 3 from both, so a step whose inputs
are neither finished nor about to run in this invocation is an error naming the step to run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polytrain.io.atomic import write_text_atomic
from polytrain.errors import ConfigError

STEPS = ("sft", "reward", "ppo")
"""Step names in order: step n is STEPS[n - 1]."""
ALIASES = {"1": "sft", "2": "reward", "3": "ppo", "grpo": "ppo", "rm": "reward"}
COMPLETE = "complete.json"
NEEDS = {"sft": (), "reward": ("sft",), "ppo": ("sft", "reward")}
"""The steps whose outputs each step starts from."""


def parse_steps(text: str) -> tuple[str, ...]:
    """'1,2,3', '3', 'sft,reward' (or 'grpo' for step 3) -> step names in run order, each once."""
    names = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        name = ALIASES.get(part, part)
        if name not in STEPS:
            raise ConfigError(f"rlhf.steps: '{part}' is not a step; use 1, 2, 3 or {', '.join(STEPS)}")
        names.append(name)
    if not names:
        raise ConfigError("rlhf.steps names no step; use e.g. 1,2,3")
    return tuple(s for s in STEPS if s in names)


def step_dir(run_dir: Path, step: str) -> Path:
    """The run directory of one step."""
    return Path(run_dir) / step


def is_complete(run_dir: Path, step: str) -> bool:
    return (step_dir(run_dir, step) / COMPLETE).is_file()


def mark_complete(run_dir: Path, step: str, summary: dict[str, Any]) -> None:
    """Record that `step` finished (the last file it writes), with its summary."""
    write_text_atomic(step_dir(run_dir, step) / COMPLETE, json.dumps(summary, indent=1) + "\n")


def chat_dir(run_dir: Path) -> Path | None:
    """The run directory `polytrain chat runs/<name>` talks to: step 3's actor, else step 1's; None
    when neither step has finished."""
    for step in ("ppo", "sft"):
        if is_complete(run_dir, step):
            return step_dir(run_dir, step)
    return None


def check_inputs(run_dir: Path, steps: tuple[str, ...]) -> None:
    """ConfigError when a step to run needs a step that is neither finished nor in `steps`."""
    for step in steps:
        for need in NEEDS[step]:
            if need not in steps and not is_complete(run_dir, need):
                n = STEPS.index(need) + 1
                raise ConfigError(
                    f"step {STEPS.index(step) + 1} ({step}) needs step {n} ({need}), and "
                    f"{step_dir(run_dir, need)} holds no finished run; run it first: --rlhf.steps "
                    f"{','.join(str(STEPS.index(s) + 1) for s in STEPS if s == need or s in steps)}")
