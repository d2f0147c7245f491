"""Value models (model.head = "value"): a decoder's last hidden state times one weight row, on every decoder of the zoo."""

import dataclasses

import pytest
import torch

from polytrain.config import Config, load_config
from polytrain.distributed.materialize import materialize
from polytrain.errors import ConfigError
from polytrain.models import ARCHITECTURES
from polytrain.models.common.value_head import ScalarHead, is_scalar_model
from polytrain.models.registry import model_config, resolve_model, shape_config


def _cfg(arch, **extra):
    cfg = Config(model=model_config(arch, dim=32, n_layers=2, n_heads=4, n_kv_heads=0, ffn_dim=64,
                                    vocab_size=50, max_seq_len=16, **extra))
    resolve_model(cfg)
    return cfg.model


@pytest.mark.parametrize("arch", ["llama", "gpt2", "internlm2"])
def test_values_are_the_last_hidden_state_times_the_head(arch):
    cfg = _cfg(arch, head="value", tie_embeddings=False)
    with torch.device("meta"):
        model = ARCHITECTURES[arch].build(cfg)
    materialize(model, torch.device("cpu"), seed=3)  # initialised by name, head included
    assert is_scalar_model(model) and model.output.weight.shape == (1, 32)
    assert model.output.weight.abs().sum() > 0
    assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()
    tokens = torch.randint(0, 50, (2, 7))
    values = model(tokens)
    assert values.shape == (2, 7)
    head = model.output
    model.output = None  # the decoder now returns its last hidden states
    hidden = model(tokens)  # (2, 7, 32)
    model.output = head
    want = hidden.double() @ head.weight.double()[0]
    torch.testing.assert_close(values.double(), want, rtol=1e-5, atol=1e-6)
    values.sum().backward()  # the head and the body both train
    assert head.weight.grad.abs().sum() > 0 and model.layers["0"].attention_norm.weight.grad is not None


def test_language_model_weights_load_into_the_value_model():
    cfg = _cfg("llama")
    lm = ARCHITECTURES["llama"].build(cfg)
    value_model = ARCHITECTURES["llama"].build(dataclasses.replace(cfg, head="value"))
    state = {k: v for k, v in lm.state_dict().items() if k != "output.weight"}
    missing, unexpected = value_model.load_state_dict(state, strict=False)
    assert missing == ["output.weight"] and unexpected == []
    tokens = torch.randint(0, 50, (1, 5))
    lm.output = ScalarHead(32)
    lm.output.weight.data.copy_(value_model.output.weight)
    torch.testing.assert_close(lm(tokens), value_model(tokens))
    # A checkpoint records the head of a value model only: older LM checkpoints still match.
    assert "head" not in shape_config(cfg) and shape_config(value_model.cfg)["head"] == "value"


def test_head_key_loads_and_refuses_what_cannot_hold_a_value_head():
    cfg = load_config(None, ["--model.arch", "gpt2", "--model.head", "value"])
    assert cfg.model.head == "value" and not cfg.model.tie_embeddings  # gpt2's tying is for its LM head
    for args, message in ((["--model.arch", "bert"], "needs a decoder"),
                          (["--model.tie_embeddings", "true"], "set model.tie_embeddings = false")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["--model.head", "value", *args])
    from polytrain.train.startup import plan_layout

    with pytest.raises(ConfigError, match="model.head = 'value' runs with parallel.pp = 1"):
        plan_layout(load_config(None, ["--model.head", "value", "--parallel.pp", "2"]), 2)
    from polytrain.data.objectives import build_objective

    with pytest.raises(ConfigError, match="train them with `polytrain rlhf`"):
        build_objective(load_config(None, ["--model.head", "value"]), tokenizer=None)
