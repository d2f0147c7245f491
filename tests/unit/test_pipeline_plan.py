"""Pipeline plans: how stages are cut and placed, and the one-line errors for layouts that cannot work."""

from __future__ import annotations

import pytest
import torch

from polytrain.config import load_config
from polytrain.distributed.pipeline import split_model
from polytrain.errors import ConfigError
from polytrain.models import ARCHITECTURES
from polytrain.train.startup import plan_layout
from tests.e2e.test_errors import assert_one_line_error, run_cli


def plan(*args: str, dp: int = 1):
    cfg = load_config(None, ["--model.n_layers", "4", "--train.micro_batch_size", "2",
                             "--train.global_batch_size", "8", "--parallel.pp", "2", *args])
    return plan_layout(cfg, dp * cfg.parallel.pp).pipeline


def test_balanced_split_puts_the_extra_blocks_first_and_the_head_last():
    p = plan("--model.n_layers", "5")
    assert p.stages == (("tok_embeddings", "layers.0", "layers.1", "layers.2"),
                        ("layers.3", "layers.4", "norm", "output"))
    assert (p.microbatches, p.runs) == (4, 1)


def test_named_split_may_give_the_embedding_or_the_head_a_stage_of_its_own():
    p = plan("--parallel.pp", "4", "--parallel.pp_split", "layers.0, layers.3,output")
    assert p.stages == (("tok_embeddings",), ("layers.0", "layers.1", "layers.2"), ("layers.3", "norm"),
                        ("output",))


def test_interleaved_loops_over_ranks_and_zero_bubble_folds_into_a_v():
    looped = plan("--parallel.pp_schedule", "interleaved")
    assert [looped.stages_of_rank(r) for r in range(2)] == [[0, 2], [1, 3]]
    v = plan("--parallel.pp_schedule", "zero_bubble")
    assert [v.stages_of_rank(r) for r in range(2)] == [[0, 3], [1, 2]]
    assert v.stages[0][0] == "tok_embeddings" and v.stages[3][-1] == "output"


def test_several_pipeline_runs_per_step():
    p = plan("--parallel.pp_microbatches", "2")
    assert (p.microbatches, p.runs) == (2, 2)


def test_no_plan_without_pipeline():
    assert plan("--parallel.pp", "1") is None


def test_stage_modules_keep_global_names_and_together_hold_the_model():
    cfg = load_config(None, ["--model.n_layers", "4", "--parallel.pp", "2", "--parallel.pp_schedule", "zero_bubble",
                             "--train.micro_batch_size", "2", "--train.global_batch_size", "8"])
    p = plan_layout(cfg, cfg.parallel.pp).pipeline
    with torch.device("meta"):
        model = ARCHITECTURES["llama"].build(cfg.model)
    names = {}
    for rank in range(2):
        for index, stage in split_model(model, p, rank).items():
            names[int(index)] = [n for n, _ in stage.named_parameters()]
    assert names[0] == ["tok_embeddings.weight", *[n for n in names[0] if n.startswith("layers.0.")]]
    assert names[3][-2:] == ["norm.weight", "output.weight"]
    everything = [n for i in sorted(names) for n in names[i]]
    assert everything == [n for n, _ in model.named_parameters()]  # disjoint, complete, in model order


@pytest.mark.parametrize("args, message", [
    (["--parallel.pp_split", "layers.9"], "parallel.pp_split: 'layers.9' is not a module a stage can start at"),
    (["--parallel.pp_split", "tok_embeddings"], "'tok_embeddings' is not a module a stage can start at"),
    (["--parallel.pp_split", "layers.1,layers.2"], "names 2 cut(s) but 2 stages need 1"),
    (["--parallel.pp", "3", "--parallel.pp_split", "layers.3,layers.1"], "must name modules in forward order"),
    (["--parallel.pp", "8"], "parallel.pp = 8 = 8 stages but model.n_layers = 4"),
    (["--parallel.pp_schedule", "interleaved", "--parallel.pp_virtual_stages", "3"],
     "parallel.pp = 2 x parallel.pp_virtual_stages = 3 = 6 stages but model.n_layers = 4"),
    (["--parallel.pp", "4", "--train.global_batch_size", "4"],
     "2 micro-batches per pipeline run (train.global_batch_size / (train.micro_batch_size x dp)): "
     "1f1b needs at least parallel.pp = 4"),
    (["--parallel.pp_microbatches", "3"], "parallel.pp_microbatches = 3 must divide the 4 micro-batches"),
    (["--parallel.pp_schedule", "interleaved", "--train.global_batch_size", "10"],
     "the interleaved schedule runs 2 rounds of micro-batches"),
    (["--parallel.pp_schedule", "zero_bubble", "--parallel.pp_virtual_stages", "4"],
     "runs exactly 2 stages per rank; set parallel.pp_virtual_stages = 2"),
    (["--parallel.zero", "2"], "parallel.zero = 2 does not compose with parallel.pp > 1 yet; use parallel.zero = 0"),
    (["--parallel.pp", "1", "--parallel.pp_split", "layers.1"], "parallel.pp_split only applies with parallel.pp > 1"),
])
def test_layouts_that_cannot_work(args, message):
    with pytest.raises(ConfigError) as err:
        plan(*args)
    assert message in str(err.value)


def test_parallel_dims_checks_the_pipeline_at_start_up():
    cfg = load_config(None, ["--parallel.pp", "2", "--parallel.pp_split", "layers.7"])
    with pytest.raises(ConfigError, match="'layers.7' is not a module"):
        plan_layout(cfg, 2)


def test_the_command_line_says_it_in_one_line_before_starting_workers(capsys):
    code, err = run_cli(capsys, "train", "--parallel.nproc", "2", "--parallel.pp", "2",
                        "--parallel.pp_split", "layers.0,norm")
    assert_one_line_error(code, err, "parallel.pp_split names 2 cut(s) but 2 stages need 1")
