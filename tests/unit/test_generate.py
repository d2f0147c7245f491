"""KV-cached generation: greedy, batching, stopping, sampling filters, limits."""

from __future__ import annotations

import pytest
import torch

from polytrain.config import ModelConfig
from polytrain.inference.generate import argmax_rows, generate, sample
from polytrain.models.common.init import init_plain
from polytrain.models.llama.model import Llama

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97,
                  max_seq_len=48)
PROMPTS = [[5, 17, 3, 88, 42, 9, 61], [23, 4], [70, 70, 12, 1]]


@pytest.fixture(scope="module")
def model() -> Llama:
    m = Llama(CFG)
    init_plain(m, 0)
    return m


def greedy_without_cache(model: Llama, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_greedy_matches_full_forward_loop(model):
    out = generate(model, [PROMPTS[0]], 12, temperature=0)
    assert out == [greedy_without_cache(model, PROMPTS[0], 12)]


def test_batched_prompts_of_different_lengths_match_each_alone(model):
    batched = generate(model, PROMPTS, 10, temperature=0)
    alone = [generate(model, [p], 10, temperature=0)[0] for p in PROMPTS]
    assert batched == alone == [greedy_without_cache(model, p, 10) for p in PROMPTS]


def test_stop_tokens_end_rows_and_are_kept(model):
    free = generate(model, PROMPTS[:2], 10, temperature=0)
    stop = free[0][3]
    assert stop not in free[0][:3]
    out = generate(model, PROMPTS[:2], 10, temperature=0, stop_tokens={stop})
    assert out[0] == free[0][:4]
    cut = free[1].index(stop) + 1 if stop in free[1] else 10
    assert out[1] == free[1][:cut]


def test_generation_stops_once_every_row_stopped(model):
    first = generate(model, [PROMPTS[0]], 1, temperature=0)[0][0]
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = generate(model, [PROMPTS[0]], 20, temperature=0, stop_tokens={first})
    finally:
        handle.remove()
    assert out == [[first]] and len(calls) == 1  # the prefill only


def test_top_k_1_and_tiny_top_p_equal_greedy(model):
    greedy = generate(model, PROMPTS, 8, temperature=0)
    g = torch.Generator().manual_seed(0)
    assert generate(model, PROMPTS, 8, temperature=1.0, top_k=1, generator=g) == greedy
    assert generate(model, PROMPTS, 8, temperature=1.0, top_p=1e-6, generator=g) == greedy


def test_sampling_is_reproducible_with_a_generator(model):
    def run(seed):
        return generate(model, PROMPTS, 16, temperature=1.0, generator=torch.Generator().manual_seed(seed))
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_sample_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(2000, 4)
    # top_p 0.7: tokens 0 and 1 (0.8 of the mass) are the smallest set reaching it.
    assert set(sample(logits, 1.0, top_p=0.7, generator=g).tolist()) == {0, 1}
    assert set(sample(logits, 1.0, top_k=3, generator=g).tolist()) == {0, 1, 2}
    assert set(sample(logits, 1.0, generator=g).tolist()) == {0, 1, 2, 3}
    assert sample(logits[:1], 0.0).tolist() == [0]


@pytest.mark.parametrize("vocab", [100, 4096, 32000, 50257])  # too small to chunk; whole chunks; a tail
def test_chunked_argmax_is_argmax_with_its_ties_and_nans(vocab):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1, 7] = logits[1, vocab - 1] = 50.0  # a tie: the first wins
    logits[2, vocab - 1] = 50.0  # the maximum in the last, shorter chunk
    logits[3] = 2.0  # every element equal
    logits[4, 9] = logits[4, vocab // 2] = float("nan")  # argmax returns the first NaN
    logits[5, min(3 * 128 + 5, vocab - 2)] = float("inf")
    want = logits.argmax(-1)
    assert torch.equal(argmax_rows(logits), want)
    assert want[1] == 7 and want[2] == vocab - 1 and want[3] == 0 and want[4] == 9


def test_prompt_plus_new_tokens_beyond_max_seq_len_rejected(model):
    generate(model, [[1] * 40], CFG.max_seq_len - 40)  # exactly fits
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1] * 40, [2]], CFG.max_seq_len - 39)


def test_restores_training_mode_and_keeps_no_graph(model):
    grads = []
    handle = model.register_forward_hook(lambda m, args, out: grads.append(out.requires_grad))
    model.train()
    try:
        generate(model, [PROMPTS[1]], 3)
    finally:
        handle.remove()
    assert model.training and grads == [False] * 3
    model.eval()
    generate(model, [PROMPTS[1]], 3)
    assert not model.training


@pytest.mark.parametrize("kwargs", [dict(batch_size=0), dict(temperature=-1), dict(top_k=0), dict(top_p=0.0),
                                    dict(top_p=1.5)])
def test_bad_arguments_rejected(model, kwargs):
    with pytest.raises(ValueError):
        generate(model, [PROMPTS[0]], 3, **kwargs)


def test_zero_new_tokens(model):
    assert generate(model, PROMPTS, 0) == [[], [], []]


def test_static_cache_with_continuous_refill_equals_the_padded_batch(model):
    """5 prompts on 2 rows: rows that stop take the next prompt; greedy tokens are today's."""
    prompts = PROMPTS + [[9, 9, 9, 9, 9, 9, 9, 9, 9], [31]]
    free = generate(model, prompts, 10, temperature=0)
    stop = {free[0][3]}  # ends some rows early, so rows are refilled at different steps
    padded = generate(model, prompts, 10, temperature=0, stop_tokens=stop)
    assert len({len(row) for row in padded}) > 1
    for kw in (dict(static_cache=True), dict(batch_size=2), dict(batch_size=1)):
        assert generate(model, prompts, 10, temperature=0, **kw) == free, kw
        assert generate(model, prompts, 10, temperature=0, stop_tokens=stop, **kw) == padded, kw


def test_static_cache_prefills_prompts_of_one_length_together_and_refills(model):
    """Equal-length prompts share a prefill (at the start and when rows free up at one step);
    a row whose first token ends it takes the next prompt before any step."""
    prompts = [[5, 17, 3, 88], [23, 4, 61, 9], [70, 70, 12, 1], [8, 2], [44, 45, 46, 47], [3, 3],
               [60, 1, 2, 50]]
    free = generate(model, prompts, 6, temperature=0)
    stop = {free[1][0], free[2][2]}  # prompt 1 ends at its first token, prompt 2 at its third
    padded = generate(model, prompts, 6, temperature=0, stop_tokens=stop)
    for rows in (2, 3, 4, 7):
        assert generate(model, prompts, 6, temperature=0, stop_tokens=stop, batch_size=rows) == padded, rows
        assert generate(model, prompts, 1, temperature=0, batch_size=rows) == [r[:1] for r in free], rows


def test_compiled_static_decoding_equals_eager_and_compiles_once(model):
    from torch._dynamo.utils import counters

    from polytrain.inference import continuous

    before, backend = counters["stats"]["unique_graphs"], continuous.BACKEND
    continuous.BACKEND = "aot_eager"  # the graph, not inductor's kernels (test_compile.py has those)
    try:
        out = generate(model, PROMPTS, 10, temperature=0, batch_size=2, compile=True)
    finally:
        continuous.BACKEND = backend
    assert out == generate(model, PROMPTS, 10, temperature=0)
    assert counters["stats"]["unique_graphs"] - before == 1  # every decoding step: one graph


def test_compiled_calls_after_another_model_and_batch_pick_their_own_graph(model):
    """Steps after a call's first run only the guards that tell its graph from other calls': a
    call after one with another batch size or another model still decodes as eager does."""
    from polytrain.inference import continuous

    other = Llama(CFG)
    init_plain(other, 7)
    backend, continuous.BACKEND = continuous.BACKEND, "aot_eager"
    try:
        runs = [(m, rows, generate(m, PROMPTS, 8, temperature=0, batch_size=rows, compile=True))
                for m, rows in ((model, 2), (other, 3), (model, 3), (other, 2))]
    finally:
        continuous.BACKEND = backend
    assert runs[0][2] != runs[3][2]  # the two models decode differently: a wrong graph would show
    for m, rows, out in runs:
        assert out == generate(m, PROMPTS, 8, temperature=0), rows


def test_static_sampling_is_reproducible_and_follows_the_filters(model):
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a = generate(model, PROMPTS, 8, temperature=0.9, top_k=5, generator=g(), batch_size=2)
    assert a == generate(model, PROMPTS, 8, temperature=0.9, top_k=5, generator=g(), batch_size=2)
    assert generate(model, PROMPTS, 8, temperature=1.0, top_k=1, batch_size=2) == \
        generate(model, PROMPTS, 8, temperature=0)


@pytest.mark.parametrize("sharded", [False, True])
def test_compiled_steps_skip_guards_after_the_first_unless_the_model_is_sharded(monkeypatch, tmp_path, sharded):
    """A sharded (DTensor) model may change its parameters' layouts between forwards, so each of
    its compiled steps evaluates every guard; a plain model's steps after the first skip them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from polytrain.inference import continuous

    skipping: list[bool] = []  # per compiled call: whether guard evaluation was skipped
    stance = torch.compiler.set_stance

    def recording_stance(*args, **kwargs):
        skipping.append(kwargs.get("skip_guard_eval_unsafe", False))
        return stance(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", recording_stance)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # the logic around the graph only

    class Cache:
        def advance(self):
            pass

    class Model(torch.nn.Linear):  # tokens (B, 1) -> logits (B, 1, 5); a parameter to shard
        def forward(self, tokens, **_):
            return torch.zeros(tokens.shape[0], 1, 5)

    model = Model(2, 3)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        if sharded:
            mesh = init_device_mesh("cpu", (1,))
            model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
        step = continuous.decode_step(model, Cache(), True)
        for _ in range(3):
            assert step(torch.zeros(2, dtype=torch.long)).shape == (2, 5)
    finally:
        dist.destroy_process_group()
    assert skipping == ([] if sharded else [True, True])
