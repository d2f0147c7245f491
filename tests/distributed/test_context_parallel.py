"""Context-parallel attention (Ulysses, ring, hybrid) against torch's SDPA on the whole sequence.

One launch of 4 gloo ranks checks every layout: cp 4 as ring, Ulysses and hybrid 2 x 2, and
cp 2 as ring and Ulysses on two independent groups ({0, 1}, {2, 3}). For each: the
attention output and the gradients of q, k and v (gathered from the shards) equal float64
SDPA with the mask built whole, causal with packed documents and grouped-query heads, and
bidirectional with one key/value head; the bytes the collectives sent, forward and
backward, equal the analytic formulas of cost.py; and a Llama whose attention cores are
replaced, fed its shard of a packed batch with global positions, gives the single-process
logits and, summed over the cp group, the same parameter gradients (to RoPE's fp32); and
generation with the KV cache sharded over the group gives the single process's tokens.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from tests.multirank import run_ranks

pytestmark = pytest.mark.slow

LAYOUTS = {  # name: (cp groups of the world, ulysses degree)
    "ring4": ([[0, 1, 2, 3]], 1),
    "ulysses4": ([[0, 1, 2, 3]], 4),
    "hybrid2x2": ([[0, 1, 2, 3]], 2),
    "ring2": ([[0, 1], [2, 3]], 1),
    "ulysses2": ([[0, 1], [2, 3]], 2),
}
B, T, D = 2, 48, 8
CASES = {"causal_packed_gqa": (True, True, 4, 2), "bidirectional_mqa": (False, False, 4, 1)}


def _documents(seed: int) -> torch.Tensor:
    """(B, T) ids: row 0 packs documents of random lengths, row 1 is one document."""
    starts = torch.rand(T, generator=torch.Generator().manual_seed(seed)) < 0.1
    return torch.stack([starts.long().cumsum(0), torch.zeros(T, dtype=torch.long)])


def _sdpa(q, k, v, causal, docs):
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool).tril()
    if docs is not None:
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=allowed)


def _attention_case(cp, case, seed):
    from polytrain.distributed.collectives import comm_stats
    from polytrain.distributed.context_parallel.cost import attention_bytes

    causal, packed, H, Hkv = CASES[case]
    g = torch.Generator().manual_seed(seed)  # the same whole tensors on every rank
    q, k, v = (torch.randn(B, h, T, D, dtype=torch.float64, generator=g) for h in (H, Hkv, Hkv))
    grad = torch.randn(B, H, T, D, dtype=torch.float64, generator=g)
    docs = _documents(seed) if packed else None
    leaves = [x.requires_grad_() for x in (q, k, v)]
    ref = _sdpa(*leaves, causal, docs)
    ref_grads = torch.autograd.grad(ref, leaves, grad)

    local = [cp.shard(x, dim=2).detach().requires_grad_() for x in (q, k, v)]
    with comm_stats() as forward:
        out = cp.attention(*local, causal, None, docs)
    with comm_stats() as backward:
        out.backward(cp.shard(grad, dim=2))
    want_fwd, want_bwd = attention_bytes(B, T, H, Hkv, D, cp.groups.ring_size, cp.groups.ulysses_size, 8, 8)
    errors = {"out": (cp.groups.gather(out.detach(), 2) - ref).abs().max().item()}
    for name, x, want in zip("qkv", local, ref_grads):
        errors[f"d{name}"] = (cp.groups.gather(x.grad, 2) - want).abs().max().item()
    return errors, (forward.total_bytes, want_fwd), (backward.total_bytes, want_bwd)


def _model_case(cp, seed):
    """A 2-block Llama with cp cores on this rank's shard vs the same model on the whole batch."""
    from polytrain.config import ModelConfig
    from polytrain.distributed.collectives import all_reduce
    from polytrain.models.common.documents import document_positions
    from polytrain.models.common.init import init_plain
    from polytrain.models.llama.model import Llama

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=53, max_seq_len=T)
    ref = Llama(cfg).double()
    init_plain(ref, seed)
    model = Llama(cfg).double()
    model.load_state_dict(ref.state_dict())
    cp.apply(model)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
    docs = _documents(seed + 1)
    positions = document_positions(docs)
    weights = torch.randn(B, T, cfg.vocab_size, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    want = ref(tokens, positions=positions, documents=docs)
    (want * weights).sum().backward()
    cp.documents = docs
    got = model(cp.shard(tokens), positions=cp.shard(positions), documents=cp.shard(docs))
    (got * cp.shard(weights)).sum().backward()
    errors = {"logits": (cp.groups.gather(got.detach()) - want).abs().max().item()}
    grads = dict(ref.named_parameters())
    errors["grads"] = max(((all_reduce(p.grad, cp.groups.cp) - grads[n].grad).abs().max()
                           / grads[n].grad.abs().max()).item() for n, p in model.named_parameters())
    return errors, _generation(ref, model, cp, seed)


def _generation(ref, model, cp, seed):
    """Greedy tokens of a 37-token prompt, and of a 3-token one (shorter than the layout's chunks:
    decoded token by token, some ranks' caches start empty): KV cache sharded over the cp group vs
    one process."""
    from polytrain.inference.cp_generate import generate_cp
    from polytrain.inference.generate import generate

    cp.documents = None
    prompt = torch.randint(0, ref.cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ([generate_cp(model, cp, p, 8, temperature=0) for p in (prompt, prompt[:3])],
            [generate(ref, [p], 8, temperature=0)[0] for p in (prompt, prompt[:3])])


def _body(rank, world_size):
    from polytrain.distributed.context_parallel import ContextParallel, new_cp_groups

    results = {}
    for name, (groups, ulysses) in LAYOUTS.items():
        cp = ContextParallel(new_cp_groups(groups, ulysses), block=4)
        for case in CASES:
            results[(name, case)] = _attention_case(cp, case, seed=len(results))
        if name in ("ring4", "ulysses4", "hybrid2x2"):
            results[(name, "model")] = _model_case(cp, seed=7)
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(4, _body)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_outputs_and_gradients_equal_sdpa(results, layout, case):
    for rank_results in results:
        errors, _, _ = rank_results[(layout, case)]
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_sent_equal_the_formulas(results, layout):
    for rank_results in results:
        for case in CASES:
            _, forward, backward = rank_results[(layout, case)]
            assert forward[0] > 0 and forward[0] / forward[1] == pytest.approx(1.0, abs=1e-9), (case, forward)
            assert backward[0] / backward[1] == pytest.approx(1.0, abs=1e-9), (case, backward)


@pytest.mark.parametrize("layout", ["ring4", "ulysses4", "hybrid2x2"])
def test_model_with_cp_cores_equals_the_single_process_model(results, layout):
    for rank_results in results:
        errors, _ = rank_results[(layout, "model")]
        # RoPE rotates in fp32 (models/common/rope.py), hence not float64's 1e-12.
        assert errors["logits"] < 1e-6 and errors["grads"] < 1e-6, errors


@pytest.mark.parametrize("layout", ["ring4", "ulysses4", "hybrid2x2"])
def test_generation_with_a_sharded_kv_cache_equals_one_process(results, layout):
    """Prefill of 32-36 tokens over the group, the rest of the prompt and 8 new tokens decoded."""
    for rank_results in results:
        _, (sharded, single) = rank_results[(layout, "model")]
        assert sharded == single and [len(s) for s in single] == [8, 8]
