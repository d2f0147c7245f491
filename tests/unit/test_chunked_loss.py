"""The chunked output projection + cross-entropy equals the plain logits -> F.cross_entropy path."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.train.chunked_loss import LossHead, chunk_tokens, linear_cross_entropy
from tests.conftest import tiny_overrides


def _inputs(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 100, 16, generator=g, requires_grad=True)  # (B, T, D)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)  # (V, D)
    b = torch.randn(50, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, 50, (3, 100), generator=g)
    targets[:, ::7] = -100  # not scored (BERT's unmasked tokens, T5's padding)
    return hidden, weight, b, targets


def _loss_and_grads(fn, hidden, weight, bias, targets, scale=3.0):
    params = [p for p in (hidden, weight, bias) if p is not None]
    for p in params:
        p.grad = None
    loss = fn(hidden, weight, bias, targets)
    (loss * scale).backward()  # a loss scale or micro-batch weight reaches every gradient
    return loss.detach(), [p.grad.clone() for p in params]


def _plain(hidden, weight, bias, targets):
    return F.cross_entropy(F.linear(hidden, weight, bias).float().flatten(0, -2), targets.flatten())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [64, 128, 1000])  # 300 tokens: uneven last chunk, 3 chunks, one chunk
def test_loss_and_gradients_equal_the_plain_path(bias, chunk):
    inputs = _inputs(bias)
    want_loss, want_grads = _loss_and_grads(_plain, *inputs)
    got_loss, got_grads = _loss_and_grads(
        lambda *a: linear_cross_entropy(*a, chunk=chunk), *inputs)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_kernels_match_the_plain_path(autocast):
    """train.compile's per-chunk kernels (inductor): the plain path's loss and gradients, with a
    bias, unscored tokens and an uneven last chunk (two chunk shapes)."""
    inputs = _inputs(bias=True, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want_loss, want_grads = _loss_and_grads(_plain, *inputs)
        got_loss, got_grads = _loss_and_grads(
            lambda *a: linear_cross_entropy(*a, chunk=128, compile_backend="inductor"), *inputs)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    for got, want in zip(got_grads, want_grads):
        tolerance = 2e-2 if autocast else 1e-5
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_under_bf16_autocast_matches_the_plain_path_to_bf16_precision():
    inputs = _inputs(bias=True, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, want_grads = _loss_and_grads(_plain, *inputs)
        got_loss, got_grads = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk=64), *inputs)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)  # both from the same bf16 logits
    for got, want in zip(got_grads, want_grads):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_without_grad_only_the_loss_is_computed():
    hidden, weight, bias, targets = _inputs(bias=True)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, bias, targets, chunk=64)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, _plain(hidden, weight, bias, targets).detach())


def test_all_targets_ignored_gives_zero_loss_and_gradients():
    hidden, weight, _, targets = _inputs(bias=False)
    loss = linear_cross_entropy(hidden, weight, None, torch.full_like(targets, -100))
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_a_chunks_logits_are_about_the_size_of_the_hidden_states():
    assert chunk_tokens(8192, 4096, 128_000) == 263  # ceil(8192 * 4096 / 128000): logits about the size of the hidden states
    assert chunk_tokens(2048, 192, 4096) == 256  # never fewer tokens than a useful matmul


def test_loss_head_keeps_the_linears_parameters_and_acts_as_it_outside_scoring():
    emb, linear = nn.Embedding(50, 16), nn.Linear(16, 50, bias=False)
    linear.weight = emb.weight  # tied, as a model with tie_embeddings
    head = LossHead.replacing(linear)
    assert head.weight is emb.weight and head.bias is None
    assert list(head.state_dict()) == ["weight"]
    hidden, _, _, targets = _inputs(bias=False)
    torch.testing.assert_close(head(hidden), linear(hidden))  # logits: (B, T, V)
    with head.scoring(targets):
        loss = head(hidden)
    assert loss.shape == () and head.targets is None
    torch.testing.assert_close(loss, _plain(hidden, emb.weight, None, targets))


def _train_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


@pytest.mark.parametrize("model_args", [
    ["--model.tie_embeddings", "true"],  # llama, tied: the head's gradient meets the embedding's
    ["--model.arch", "bert", "--model.n_kv_heads", "4"],  # biased MLM head, most targets ignored
])
def test_training_with_and_without_chunked_loss_follows_the_same_curve(model_args, small_corpus, tmp_path):
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    rows = {}
    for chunked in ("true", "false"):
        run_dir = tmp_path / chunked
        overrides = tiny_overrides(small_corpus, run_dir, run__steps=4) + model_args
        trainer = Trainer(load_config(None, overrides + ["--train.chunked_loss", chunked]))
        assert (trainer.loss.head is not None) == (chunked == "true")
        trainer.train()
        rows[chunked] = _train_rows(run_dir)
    assert len(rows["true"]) == 4
    for a, b in zip(rows["false"], rows["true"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("compile_backend", [None, "inductor"])
def test_fp16_gradients_keep_small_probabilities(compile_backend):
    # Half the vocabulary is e^-9 less likely: probabilities ~2.4e-7, a few fp16 subnormal
    # steps. Their weight gradients (the whole gradient of those rows) must survive fp16.
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(256, 16, generator=g, requires_grad=True)
    weight = (0.02 * torch.randn(1024, 16, generator=g)).requires_grad_()
    bias = torch.cat([torch.zeros(512), torch.full((512,), -9.0)]).requires_grad_()
    targets = torch.randint(0, 512, (256,), generator=g)
    _, want = _loss_and_grads(_plain, hidden, weight, bias, targets)  # fp32
    with torch.autocast("cpu", dtype=torch.float16):  # fp32 parameters, fp16 matmuls
        got_loss, got = _loss_and_grads(
            lambda *a: linear_cross_entropy(*a, chunk=128, compile_backend=compile_backend),
            hidden, weight, bias, targets)
    assert torch.isfinite(got_loss)
    rare = slice(512, None)
    for got_grad, want_grad in (got[1][rare], want[1][rare]), (got[2][rare], want[2][rare]):
        assert ((got_grad - want_grad).norm() / want_grad.norm()).item() < 1e-2
