"""`polytrain rlhf` end to end on the built-in task, a tiny model, seconds: the three run directories, their
metrics rows, a resume that reproduces the run exactly, finished steps skipped, step 3 without its inputs
as one line naming the step to run, step 3 through the training layout (rlhf.hybrid_engine false) with the
frozen models offloaded giving the engine's numbers, PPO epochs over mini-batches engaging the clip, GRPO over
mini-batches with the EMA actor and the pre-training mix, and `polytrain chat`.
"""

from __future__ import annotations

import io
import json
import shutil

import pytest

from polytrain.cli import main
from polytrain.train.metrics import read_metrics

pytestmark = pytest.mark.slow


def _args(run_dir, *extra: str) -> list[str]:
    values = {
        "run.out_dir": run_dir, "run.steps": 4, "run.log_every": 1, "run.eval_every": 0, "run.seed": 3,
        "model.dim": 16, "model.n_layers": 1, "model.n_heads": 2, "model.n_kv_heads": 2, "model.ffn_dim": 32,
        "model.vocab_size": 288, "model.max_seq_len": 32, "data.seq_len": 32,
        "train.micro_batch_size": 4, "train.global_batch_size": 8, "train.warmup_steps": 1,
        "rlhf.task_pairs": 120, "rlhf.task_demos": 40, "rlhf.eval_rows": 8, "rlhf.data_split": "0,5,5",
        "rlhf.max_prompt_len": 16, "rlhf.max_new_tokens": 6, "checkpoint.keep": 0,
    }
    return ["rlhf", *(x for k, v in values.items() for x in (f"--{k}", str(v))), *extra]


def _step_rows(run_dir, step):
    return [r for r in read_metrics(run_dir / step) if "eval_reward" not in r and "val_loss" not in r]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rlhf")
    run_dir = root / "run"
    assert main(_args(run_dir, "--rlhf.steps", "1,2")) == 0
    assert main(_args(run_dir, "--rlhf.steps", "3", "--checkpoint.every", "2")) == 0
    return run_dir


def test_three_steps_write_ordinary_run_directories(run):
    for step in ("sft", "reward", "ppo"):
        d = run / step
        for name in ("config.toml", "tokenizer.json", "metrics.jsonl", "loss.png", "complete.json",
                     "tokenizer_config.json", "checkpoints/step_4/trainer.json"):
            assert (d / name).exists(), f"{step}/{name}"
    assert (run / "reward" / "reward.png").is_file() and (run / "ppo" / "reward.png").is_file()
    held_out = [r for r in read_metrics(run / "reward") if "accuracy" in r]
    assert [r["step"] for r in held_out] == [0, 4]
    assert all(set(r) >= {"step", "accuracy", "chosen_score", "rejected_score"} for r in held_out)
    rows = _step_rows(run, "ppo")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert set(r) >= {"step", "reward", "kl", "policy_loss", "value_loss", "clip_frac", "response_len",
                          "task_score", "entropy"}
        assert 0 <= r["task_score"] <= 1 and 0 < r["response_len"] <= 6
        for key in ("time_generate", "time_experience", "time_train", "gen_tokens_per_s", "peak_gb_generate",
                    "peak_gb_experience", "peak_gb_train"):
            assert r[key] > 0, key
        assert r["gen_tokens_per_s"] == pytest.approx(8 * r["response_len"] / r["time_generate"], rel=1e-6)
    evals = [r for r in read_metrics(run / "ppo") if "eval_task_score" in r]
    assert [r["step"] for r in evals] == [0, 4]
    summary = json.loads((run / "ppo" / "complete.json").read_text())
    assert summary["step"] == 4 and summary["first_eval_task_score"] == evals[0]["eval_task_score"]


def test_a_resumed_step_repeats_the_run_and_finished_steps_are_skipped(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "ppo" / "complete.json").unlink()  # step 3 cut short after its step-2 checkpoint
    shutil.rmtree(copy / "ppo" / "checkpoints" / "step_4")
    capsys.readouterr()
    assert main(_args(copy, "--checkpoint.every", "2")) == 0
    out = capsys.readouterr().out
    assert "step 1 (sft):" in out and "complete; skipped" in out and "resumed from" in out
    want, got = _step_rows(run, "ppo"), _step_rows(copy, "ppo")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(want[2:], got[2:]):  # steps 3 and 4, after the resume: the same samples and numbers
        for key in ("reward", "kl", "policy_loss", "value_loss", "task_score", "response_len"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key
    assert main(_args(copy)) == 0
    assert capsys.readouterr().out.count("complete; skipped") == 3


def test_step_3_without_a_reward_model_is_one_line_naming_step_2(run, tmp_path, capsys):
    fresh = tmp_path / "fresh"
    assert main(_args(fresh, "--rlhf.steps", "3")) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: step 3 (ppo) needs step 1 (sft), and {fresh / 'sft'} holds no finished run; "
        "run it first: --rlhf.steps 1,3"]
    shutil.copytree(run / "sft", fresh / "sft")  # step 1 finished, step 2 never ran
    assert main(_args(fresh, "--rlhf.steps", "grpo")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 3 (ppo) needs step 2 (reward)" in err[0] and err[0].endswith("--rlhf.steps 2,3")


def test_step_3_without_the_engine_and_with_offloaded_frozen_models_gives_the_same_run(run, tmp_path):
    off = tmp_path / "off"
    shutil.copytree(run, off, ignore=shutil.ignore_patterns("ppo"))
    assert main(_args(off, "--rlhf.hybrid_engine", "false", "--rlhf.offload_reference", "true",
                      "--rlhf.offload_reward", "true")) == 0
    want, got = read_metrics(run / "ppo"), read_metrics(off / "ppo")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got):  # every step's rollout, losses and the held-out evaluations
        for key in ("reward", "kl", "policy_loss", "value_loss", "task_score", "response_len", "eval_reward",
                    "eval_task_score"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)


def test_ppo_epochs_over_mini_batches_engage_the_clip(run, tmp_path):
    """rlhf.ppo_epochs 2 x rlhf.ppo_mini_batches 2: four actor and critic steps per rollout; from the second on
    the actor has left the rollout's log-probabilities, so ratios leave 1 +- policy_clip and clip_frac > 0
    (one epoch of one mini-batch logs 0: the fixture's run)."""
    assert all(r["clip_frac"] == 0 for r in _step_rows(run, "ppo"))
    epochs = tmp_path / "epochs"
    shutil.copytree(run, epochs, ignore=shutil.ignore_patterns("ppo"))
    assert main(_args(epochs, "--rlhf.ppo_steps", "2", "--rlhf.ppo_epochs", "2", "--rlhf.ppo_mini_batches", "2",
                      "--rlhf.actor_lr", "1e-2", "--rlhf.temperature", "0.8")) == 0
    rows = _step_rows(epochs, "ppo")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["clip_frac"] > 0 and r["grad_norm"] > 0 and r["critic_grad_norm"] > 0 for r in rows)
    assert rows[1]["kl"] != 0  # the second rollout is scored by an actor that has left the reference


def test_grpo_over_mini_batches_with_ema_and_ptx_then_chat(run, tmp_path):
    grpo = tmp_path / "grpo"
    shutil.copytree(run, grpo, ignore=shutil.ignore_patterns("ppo"))
    assert main(_args(grpo, "--rlhf.algorithm", "grpo", "--rlhf.group_size", "4", "--rlhf.ema", "true",
                      "--rlhf.ptx_coef", "0.5", "--rlhf.ppo_mini_batches", "2")) == 0
    rows = _step_rows(grpo, "ppo")
    assert len(rows) == 4 and not any("value_loss" in r for r in rows)  # no critic
    assert all("kl_loss" in r and "ptx_loss" in r for r in rows)
    assert (grpo / "ppo" / "ema" / "checkpoints" / "step_4" / "trainer.json").is_file()
    from polytrain.inference.chat import Chat, repl
    from polytrain.inference.load import load_run
    from polytrain.rlhf.plan import chat_dir

    for run_dir in (chat_dir(grpo), grpo / "ppo" / "ema"):
        out = io.StringIO()
        repl(Chat(load_run(run_dir), run_dir, max_new_tokens=4), ["sort 3 1 2\n"], out)
        assert out.getvalue().count("> ") == 2  # one reply, then the next prompt


def test_each_step_runs_its_own_step_count_not_run_steps(run, tmp_path):
    again = tmp_path / "again"
    shutil.copytree(run, again, ignore=shutil.ignore_patterns("ppo"))
    assert main(_args(again, "--rlhf.steps", "3", "--rlhf.ppo_steps", "2")) == 0  # run.steps is 4
    assert [r["step"] for r in _step_rows(again, "ppo")] == [1, 2]
    assert json.loads((again / "ppo" / "complete.json").read_text())["step"] == 2


def test_the_actor_from_an_hf_directory_and_the_reward_model_from_a_run(run, tmp_path):
    from polytrain.convert import export_hf

    hf = export_hf(run / "sft", tmp_path / "sft_hf")  # step 1's actor as a Hugging Face model
    again = tmp_path / "again"
    assert main(_args(again, "--rlhf.actor_from", str(hf), "--rlhf.reward_from", str(run / "reward"),
                      "--rlhf.steps", "1,2", "--run.steps", "1")) == 0
    assert (again / "base" / "actor" / "checkpoints" / "step_0").is_dir()  # imported once
    # Both start from the given weights: the first held-out rows equal the old runs' last ones.
    for step, key in (("sft", "val_loss"), ("reward", "accuracy")):
        old = [r for r in read_metrics(run / step) if key in r][-1]
        new = [r for r in read_metrics(again / step) if key in r][0]
        assert new["step"] == 0 and new[key] == pytest.approx(old[key], rel=1e-5), step
