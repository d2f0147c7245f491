"""Which steps run, and a step without the outputs it starts from as one line naming the step to run."""

import pytest

from polytrain.data import sort_task
from polytrain.errors import ConfigError
from polytrain.rlhf.plan import chat_dir, check_inputs, is_complete, mark_complete, parse_steps
from polytrain.rlhf.task import builtin_tokenizer, task_data


def test_parse_steps():
    assert parse_steps("1,2,3") == ("sft", "reward", "ppo")
    assert parse_steps("3, 1") == ("sft", "ppo")  # run order, whatever the order given
    assert parse_steps("reward,grpo") == ("reward", "ppo")
    for bad, message in (("4", "'4' is not a step"), ("", "names no step")):
        with pytest.raises(ConfigError, match=message):
            parse_steps(bad)


def test_a_step_needs_the_steps_it_starts_from(tmp_path):
    check_inputs(tmp_path, ("sft", "reward", "ppo"))  # all in one invocation: fine
    with pytest.raises(ConfigError, match=r"step 3 \(ppo\) needs step 1 \(sft\).*--rlhf.steps 1,3$"):
        check_inputs(tmp_path, ("ppo",))
    mark_complete(tmp_path, "sft", {"step": 10})
    assert is_complete(tmp_path, "sft")
    with pytest.raises(ConfigError, match=r"step 3 \(ppo\) needs step 2 \(reward\), and .*reward holds no "
                                          r"finished run; run it first: --rlhf.steps 2,3"):
        check_inputs(tmp_path, ("ppo",))
    mark_complete(tmp_path, "reward", {"step": 10})
    check_inputs(tmp_path, ("ppo",))
    assert chat_dir(tmp_path) == tmp_path / "sft"  # chat talks to the newest finished actor
    mark_complete(tmp_path, "ppo", {"step": 10})
    assert chat_dir(tmp_path) == tmp_path / "ppo"
    assert chat_dir(tmp_path / "elsewhere") is None


def test_builtin_task_data():
    data = task_data([], None, seed=1, n_pairs=50, n_demos=20, noise=0.3)
    demos, pairs = data.sources
    assert demos.kind == "demos" and pairs.kind == "pairs" and len(pairs.rows) == 50
    assert data.scorer is sort_task.task_score
    tok = builtin_tokenizer(300)
    row = pairs.rows[0]
    assert tok.decode(tok.encode(row.prompt + row.chosen)) == row.prompt + row.chosen
    assert len(tok.encode(row.chosen)) == len(row.chosen.split())  # one token per " d"
    weighted = task_data([], [2.0, 1.0], seed=1, n_pairs=50, n_demos=20, noise=0.3)
    assert [s.weight for s in weighted.sources] == [2.0, 1.0]


def test_rlhf_keys_load_from_the_command_line_and_fail_one_line_each():
    from polytrain.config import load_config, to_toml

    cfg = load_config(None, ["--rlhf.steps", "3", "--rlhf.data", "a.jsonl,b.jsonl", "--rlhf.data_weights", "2,1",
                             "--rlhf.data_split", "1,1,1", "--rlhf.algorithm", "grpo"])
    assert (cfg.rlhf.steps, cfg.rlhf.data, cfg.rlhf.algorithm) == ("3", "a.jsonl,b.jsonl", "grpo")
    assert cfg.rlhf.kl_coef == 0.1 and cfg.rlhf.lam == 0.95 and cfg.rlhf.reward_clip == 5.0  # DeepSpeed-Chat's
    assert "[rlhf]" in to_toml(cfg)
    for args, message in ((["--rlhf.group_size", "1"], "rlhf.group_size = 1 must be at least 2"),
                          (["--rlhf.lam", "1.5"], r"rlhf.lam = 1.5 must be in \[0, 1\]"),
                          (["--rlhf.algorithm", "dpo"], "rlhf.algorithm = 'dpo' is not one of"),
                          (["--rlhf.max_new_tokens", "0"], "rlhf.max_new_tokens = 0 must be positive"),
                          (["--rlhf.ppo_epochs", "0"], "rlhf.ppo_epochs = 0 must be at least 1"),
                          (["--rlhf.ppo_mini_batches", "0"], "rlhf.ppo_mini_batches = 0 must be at least 1")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, args)


def test_step_3_keys_are_checked_at_start_up_one_line_each(tmp_path):
    from polytrain.config import load_config
    from polytrain.rlhf.run import check_rlhf

    base = ["--run.out_dir", str(tmp_path), "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
            "--model.n_kv_heads", "2", "--model.ffn_dim", "64", "--model.vocab_size", "64", "--train.global_batch_size",
            "4", "--train.micro_batch_size", "1"]
    defaults = load_config(None, base).rlhf
    assert defaults.hybrid_engine and defaults.inference_tp == 1 and defaults.gather_blocks == 0
    assert not defaults.offload_reference and not defaults.offload_reward
    check_rlhf(load_config(None, base + ["--rlhf.inference_tp", "2", "--rlhf.gather_blocks", "1"]), 2)
    check_rlhf(load_config(None, base + ["--rlhf.ppo_mini_batches", "2", "--rlhf.ppo_epochs", "3"]), 2)
    for args, world, message in (
            (["--rlhf.inference_tp", "0"], 1, r"rlhf.inference_tp = 0 must be >= 1"),
            (["--rlhf.gather_blocks", "-1"], 1, r"rlhf.gather_blocks = -1 must be >= 0"),
            (["--rlhf.inference_tp", "2", "--rlhf.hybrid_engine", "false"], 2,
             r"rlhf.hybrid_engine = false generates through the training layout: set inference_tp to 1$"),
            (["--rlhf.inference_tp", "2", "--rlhf.actor_tp", "2"], 2, r"trains at tp 2 .* set inference_tp to 1$"),
            (["--rlhf.inference_tp", "4"], 2, r"rlhf.inference_tp = 4 must divide the 2 rank\(s\).*fit: 1, 2$"),
            (["--rlhf.inference_tp", "3"], 3, r"rlhf.inference_tp = 3 must divide the 3 rank\(s\) and split "
                                              r"the actor's heads and FFN; values that fit: 1$"),
            (["--rlhf.ppo_mini_batches", "3"], 1, r"rlhf.ppo_mini_batches = 3 must cut train.global_batch_size = 4 "
                                                  r"into equal mini-batches .*values that fit: 1, 2, 4$"),
            (["--rlhf.ppo_mini_batches", "4"], 2, r"rlhf.ppo_mini_batches = 4 .*\(the actor's 2, the critic's 2\); "
                                                  r"values that fit: 1, 2$")):
        with pytest.raises(ConfigError, match=message) as err:
            check_rlhf(load_config(None, base + args), world)
        assert "\n" not in str(err.value)
    # Steps 1 and 2 alone do not sample: the engine keys are not theirs to refuse.
    check_rlhf(load_config(None, base + ["--rlhf.inference_tp", "3", "--rlhf.steps", "1,2"]), 1)
