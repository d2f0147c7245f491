"""Every architecture trains on the tier's accelerator with the CPU's losses, and `polytrain
generate` on the device samples the CPU's greedy tokens from a device-trained checkpoint.

One process on the device trains each registered architecture (llama, gpt2, internlm2, bert as a
masked LM, t5 with span corruption) for a few steps, then greedily generates from the final
checkpoint of each that generates (all but the encoder bert); this process trains the same runs
on the CPU and generates from the device's checkpoints.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.distributed.test_parity import assert_same_trajectory, train, train_rows
from tests.distributed.test_zoo_parallel import arch_overrides
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
RTOL = 1e-5  # as tests/device/test_training.py
STEPS = 4
PROMPT = "The"


def few_steps(corpus, run_dir, arch: str) -> list[str]:
    """A tiny `arch` run of STEPS steps; its final checkpoint is what generate loads."""
    return arch_overrides(corpus, run_dir, arch, "--run.steps", str(STEPS))


def generate_argv(run_dir) -> list[str]:
    """`polytrain generate`'s greedy sampling (temperature 0) of a few tokens."""
    return ["generate", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0"]


def polytrain_generate(argv: list[str]) -> str:
    """What `polytrain generate` prints, run in this process."""
    from polytrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def _train_then_generate(rank: int, world_size: int, runs: list[list[str]],
                         generations: list[list[str]]) -> tuple[str, list[str]]:
    from polytrain.backend import get_accelerator

    for overrides in runs:
        train(overrides)
    return get_accelerator().name, [polytrain_generate(argv) for argv in generations]


def test_architectures_train_and_generate_as_on_the_cpu(on_tier, small_corpus, tmp_path):
    from polytrain.models import ARCHITECTURES

    archs = list(ARCHITECTURES)
    generating = [arch for arch in archs if ARCHITECTURES[arch].kind != "encoder"]  # bert samples no text
    runs = {arch: few_steps(small_corpus, tmp_path / arch, arch) for arch in archs}
    generations = [generate_argv(tmp_path / arch) for arch in generating]
    name, device_texts = run_ranks(1, _train_then_generate, list(runs.values()), generations)[0]
    assert name == on_tier["POLYTRAIN_ACCELERATOR"]
    for arch in archs:
        cpu_dir = tmp_path / f"cpu_{arch}"
        train(few_steps(small_corpus, cpu_dir, arch))
        reference = train_rows(cpu_dir)
        assert len(reference) == STEPS, arch
        assert_same_trajectory(reference, train_rows(tmp_path / arch), RTOL, f"{arch} on the device")
    for arch, argv, device_text in zip(generating, generations, device_texts):
        cpu_text = polytrain_generate(argv)  # the CPU's sampling of the device-trained checkpoint
        assert device_text == cpu_text, arch
        assert cpu_text.strip() not in ("", PROMPT), f"{arch} generated nothing"
