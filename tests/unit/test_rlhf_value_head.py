"""The scalar head: a decoder's last hidden state times one weight row, on any decoder of the zoo."""

import pytest
import torch

from polytrain.models.registry import model_config, resolve_model
from polytrain.distributed.materialize import materialize
from polytrain.errors import ConfigError
from polytrain.models import ARCHITECTURES
from polytrain.rlhf.value_head import ScalarHead, attach_scalar_head, is_scalar_model


def _cfg(arch):
    from polytrain.config import Config

    cfg = Config(model=model_config(arch, dim=32, n_layers=2, n_heads=4, n_kv_heads=0, ffn_dim=64,
                                    vocab_size=50, max_seq_len=16))
    resolve_model(cfg)
    return cfg.model


@pytest.mark.parametrize("arch", ["llama", "gpt2", "internlm2"])
def test_values_are_the_last_hidden_state_times_the_head(arch):
    cfg = _cfg(arch)
    with torch.device("meta"):
        model = attach_scalar_head(ARCHITECTURES[arch].build(cfg))
    materialize(model, torch.device("cpu"), seed=3)  # initialised by name, head included
    assert is_scalar_model(model) and model.output.weight.shape == (1, 32)
    assert model.output.weight.abs().sum() > 0
    assert not model.cfg.tie_embeddings  # gpt2 arrives tied; the head is its own
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
    value_model = attach_scalar_head(ARCHITECTURES["llama"].build(cfg))
    state = {k: v for k, v in lm.state_dict().items() if k != "output.weight"}
    missing, unexpected = value_model.load_state_dict(state, strict=False)
    assert missing == ["output.weight"] and unexpected == []
    tokens = torch.randint(0, 50, (1, 5))
    lm.output = ScalarHead(32)
    lm.output.weight.data.copy_(value_model.output.weight)
    torch.testing.assert_close(lm(tokens), value_model(tokens))


def test_refuses_models_without_a_decoder_head():
    with pytest.raises(ConfigError, match="needs a decoder"):
        attach_scalar_head(ARCHITECTURES["bert"].build(_cfg("bert")))
    model = ARCHITECTURES["llama"].build(_cfg("llama"))
    model.output = None  # a pipeline stage without the head
    with pytest.raises(ConfigError, match="needs a decoder"):
        attach_scalar_head(model)
