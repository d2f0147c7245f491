"""Parallel layouts of the model zoo: which modules each pipeline stage holds, and the one-line
start-up errors for layouts an architecture cannot run."""

from __future__ import annotations

import pytest
import torch

from polytrain.config import load_config
from polytrain.distributed.pipeline import split_model
from polytrain.distributed.tensor_parallel.checks import valid_tp_degrees
from polytrain.errors import ConfigError
from polytrain.models import ARCHITECTURES
from polytrain.train.startup import plan_layout


def config(arch: str, *args: str):
    return load_config(None, ["--model.arch", arch, "--model.n_layers", "4", "--train.micro_batch_size", "2",
                              "--train.global_batch_size", "8", *args])


def test_gpt2_first_stage_holds_both_embeddings_and_the_last_its_own_tied_head():
    cfg = config("gpt2", "--parallel.pp", "2")  # tied embeddings, gpt2's default
    p = plan_layout(cfg, cfg.parallel.pp).pipeline
    assert p.stages == (("tok_embeddings", "pos_embeddings", "layers.0", "layers.1"),
                        ("layers.2", "layers.3", "norm", "output"))
    with torch.device("meta"):
        model = ARCHITECTURES["gpt2"].build(cfg.model)
    first, last = (split_model(model, p, rank)[str(rank)] for rank in range(2))
    assert first.pos_embeddings is not None and first.output is None
    assert last.pos_embeddings is None and last.tok_embeddings is None
    assert not any(n.startswith("pos_embeddings") for n, _ in last.named_parameters())
    # The head's copy of the tied table (pipeline/tied.py keeps the two equal).
    assert "output.weight" in dict(last.named_parameters()) and "output.weight" not in dict(first.named_parameters())


@pytest.mark.parametrize("arch, args, message", [
    ("gpt2", ["--parallel.pp", "2", "--parallel.pp_split", "pos_embeddings"],
     "'pos_embeddings' is not a module a stage can start at"),
    ("bert", ["--parallel.pp", "2"],
     "parallel.pp > 1 runs decoders only (the causal LM objective); model.arch = 'bert' is an encoder model"),
    ("t5", ["--parallel.pp", "2"], "model.arch = 't5' is an encoder-decoder model"),
])
def test_pipelines_the_zoo_cannot_run(arch, args, message):
    with pytest.raises(ConfigError) as err:
        plan_layout(config(arch, *args), 2)
    assert message in str(err.value)


@pytest.mark.parametrize("arch, world, args, message", [
    # InternLM2 packs each KV head with its query heads in wqkv: tp may not exceed n_kv_heads.
    ("internlm2", 4, ["--parallel.tp", "4", "--model.n_heads", "8", "--model.n_kv_heads", "2"],
     ("parallel.tp = 4 does not split model.n_kv_heads = 2 (tp must divide it: internlm2 packs each KV head "
      "with its query heads, which then cannot be split); tp values that fit this model: 1, 2")),
    # T5's span corruption of 32 tokens: encoder 29, decoder 8 tokens; SP needs both even.
    ("t5", 2, ["--parallel.tp", "2", "--parallel.sp", "true", "--data.seq_len", "32"],
     ("parallel.sp splits the encoder's 29 and the decoder's 8 input tokens (from "
      "data.seq_len = 32) into parallel.tp = 2 equal parts; use data.seq_len = 31, or parallel.sp = false")),
])
def test_tensor_parallel_misfits_of_the_zoo(arch, world, args, message):
    with pytest.raises(ConfigError) as err:
        plan_layout(config(arch, *args), world)
    assert str(err.value) == message


def test_llama_may_share_kv_heads_where_internlm2_may_not():
    llama = config("llama", "--model.n_heads", "8", "--model.n_kv_heads", "2", "--model.ffn_dim", "64").model
    intern = config("internlm2", "--model.n_heads", "8", "--model.n_kv_heads", "2", "--model.ffn_dim", "64").model
    assert valid_tp_degrees(llama) == [1, 2, 4, 8]
    assert valid_tp_degrees(intern, ARCHITECTURES["internlm2"].tp_shares_kv_heads) == [1, 2]
    assert plan_layout(config("t5", "--parallel.tp", "2", "--parallel.sp", "true",
                              "--data.seq_len", "33"), 2).dims.sp
