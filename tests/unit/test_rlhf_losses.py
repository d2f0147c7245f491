"""RLHF arithmetic against direct float64 implementations of each formula (loops over rows and tokens)."""

import math

import pytest
import torch

from polytrain.rlhf import losses

torch.manual_seed(0)


def _batch(B=4, T=9, seed=0):
    """Random per-token tensors and a mask of one contiguous response run per row."""
    g = torch.Generator().manual_seed(seed)
    starts, lengths = [0, 2, 3, 1], [5, 1, 6, 3]  # row 1: a one-token response; row 2 ends at T
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        mask[b, starts[b]:starts[b] + lengths[b]] = True
    rand = lambda: torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    return mask, rand, [(starts[b], starts[b] + lengths[b]) for b in range(B)]


def _sigmoid_loss(x):
    return math.log1p(math.exp(-x))  # -log sigmoid(x)


def test_logprobs_and_masked_mean():
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    tokens = torch.randint(0, 7, (2, 3))
    got = losses.token_logprobs(logits, tokens)
    for b in range(2):
        for t in range(3):
            row = logits[b, t].tolist()
            want = row[tokens[b, t]] - math.log(sum(math.exp(v) for v in row))
            assert got[b, t].item() == pytest.approx(want, abs=1e-6)
    x, mask = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[True, False, True]])
    assert losses.masked_mean(x, mask).item() == 2.0
    assert losses.masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_scored_logprobs_follow_the_sampling_temperature():
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    tokens = torch.randint(0, 7, (2, 3))
    got = losses.tempered_logprobs(logits, tokens, 0.5)
    for b in range(2):
        for t in range(3):
            row = [v / 0.5 for v in logits[b, t].tolist()]  # the distribution sampled at temperature 0.5
            want = row[tokens[b, t]] - math.log(sum(math.exp(v) for v in row))
            assert got[b, t].item() == pytest.approx(want, abs=1e-6)
    plain = losses.token_logprobs(logits, tokens)
    assert not torch.allclose(got, plain)
    for temperature in (1, 0):  # 0 samples greedily: scored as the plain logits
        assert torch.equal(losses.tempered_logprobs(logits, tokens, temperature), plain)
    half = logits.to(torch.bfloat16)  # widened before the division, as the fp32 scoring of any precision
    torch.testing.assert_close(losses.tempered_logprobs(half, tokens, 0.5),
                               torch.log_softmax(half.float() / 0.5, -1).gather(-1, tokens[..., None])[..., 0])


def test_a_shared_count_makes_the_parts_add_up_to_the_whole():
    mask, rand, _ = _batch()
    logp, old, adv, values, returns = rand(), rand(), rand(), rand(), rand()
    n = mask.sum()
    whole = losses.policy_loss(logp, old, adv, mask)[0], losses.value_loss(values, old, returns, mask)
    halves = [(losses.policy_loss(logp[s], old[s], adv[s], mask[s], count=n)[0],
               losses.value_loss(values[s], old[s], returns[s], mask[s], count=n))
              for s in (slice(0, 1), slice(1, 4))]  # unequal token counts per part
    assert (halves[0][0] + halves[1][0]).item() == pytest.approx(whole[0].item(), rel=1e-9)
    assert (halves[0][1] + halves[1][1]).item() == pytest.approx(whole[1].item(), rel=1e-9)


def test_pairwise_and_end_scores():
    c, r = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    want = sum(_sigmoid_loss(a - b) for a, b in zip(c.tolist(), r.tolist())) / 5
    assert losses.pairwise_loss(c, r).item() == pytest.approx(want, rel=1e-6)
    values = torch.arange(12.0).view(2, 6)
    assert losses.end_scores(values, torch.tensor([3, 6])).tolist() == [2.0, 11.0]


def test_span_loss_follows_deepspeed_chat():
    pad = 0
    rows = [  # (chosen ids, rejected ids): differ mid-way; rejected longer; chosen a prefix; identical
        ([5, 6, 7, 8], [5, 6, 9]),
        ([5, 6], [5, 9, 9, 9, 9]),
        ([5, 6, 7], [5, 6, 7, 8]),
        ([4, 4, 4], [4, 4, 4]),
    ]
    T = 6
    ids = lambda seqs: torch.tensor([s + [pad] * (T - len(s)) for s in seqs])  # noqa: E731
    c_ids, r_ids = ids([c for c, _ in rows]), ids([r for _, r in rows])
    c_len, r_len = torch.tensor([len(c) for c, _ in rows]), torch.tensor([len(r) for _, r in rows])
    cv, rv = torch.randn(4, T, dtype=torch.float64), torch.randn(4, T, dtype=torch.float64)
    total = 0.0
    for b, (c, r) in enumerate(rows):  # DeepSpeed-Chat's rule, written out on padded lists
        cp, rp = c + [pad] * (T - len(c)), r + [pad] * (T - len(r))
        diff = [t for t in range(T) if cp[t] != rp[t] or (t < len(c)) != (t < len(r))]
        if not diff:
            start, end = T - 1, T
        else:
            start, end = diff[0], max(len(c), len(r))
        span = [_sigmoid_loss(cv[b, t].item() - rv[b, t].item()) for t in range(start, end)]
        total += sum(span) / len(span)
    got = losses.span_pairwise_loss(cv, rv, c_ids, r_ids, c_len, r_len)
    assert got.item() == pytest.approx(total / 4, rel=1e-6)
    assert losses.divergence_start(c_ids, r_ids, c_len, r_len).tolist() == [2, 1, 3, 5]


def test_kl_penalized_rewards():
    mask, rand, spans = _batch()
    logp, ref, scores = rand(), rand(), torch.tensor([7.0, -0.5, -9.0, 2.0], dtype=torch.float64)
    got = losses.kl_penalized_rewards(logp, ref, scores, mask, kl_coef=0.1, clip=5.0)
    for b, (s, e) in enumerate(spans):
        for t in range(mask.shape[1]):
            want = 0.0
            if s <= t < e:
                want = -0.1 * (logp[b, t].item() - ref[b, t].item())
                if t == e - 1:
                    want += max(-5.0, min(5.0, scores[b].item()))
            assert got[b, t].item() == pytest.approx(want, abs=1e-9)


def test_gae_matches_the_recursion_per_row():
    mask, rand, spans = _batch()
    rewards, values = rand(), rand()
    gamma, lam = 0.9, 0.95  # gamma != 1 so a wrong discount shows
    adv, ret = losses.gae(rewards, values, mask, gamma, lam)
    for b, (s, e) in enumerate(spans):
        running = 0.0
        want = {}
        for t in reversed(range(s, e)):
            next_v = values[b, t + 1].item() if t + 1 < e else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            running = delta + gamma * lam * running
            want[t] = running
        for t in range(mask.shape[1]):
            a = want.get(t, 0.0)
            assert adv[b, t].item() == pytest.approx(a, abs=1e-5)
            assert ret[b, t].item() == pytest.approx(a + values[b, t].item() if t in want else 0.0, abs=1e-5)


def test_clipped_policy_and_value_losses():
    mask, rand, spans = _batch()
    logp, old, adv = rand() * 0.3, rand() * 0.3, rand()
    values, old_values, returns = rand(), rand(), rand()
    loss, frac = losses.policy_loss(logp, old, adv, mask, clip=0.2)
    vloss = losses.value_loss(values, old_values, returns, mask, clip=0.2)
    terms, clipped, vterms = [], 0, []
    for b, (s, e) in enumerate(spans):
        for t in range(s, e):
            ratio = math.exp(logp[b, t].item() - old[b, t].item())
            a = adv[b, t].item()
            u, c = -a * ratio, -a * min(max(ratio, 0.8), 1.2)
            terms.append(max(u, c))
            clipped += c > u
            v, vo, r = values[b, t].item(), old_values[b, t].item(), returns[b, t].item()
            vc = min(max(v, vo - 0.2), vo + 0.2)
            vterms.append(max((v - r) ** 2, (vc - r) ** 2))
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert frac.item() == pytest.approx(clipped / len(terms))
    assert 0 < clipped < len(terms)  # the data exercise both branches
    assert vloss.item() == pytest.approx(0.5 * sum(vterms) / len(vterms), rel=1e-5)
    # The gradient flows only through unclipped tokens: the clipped ones contribute none.
    logp = logp.clone().requires_grad_()
    losses.policy_loss(logp, old, adv, mask, clip=0.2)[0].backward()
    assert (logp.grad[~mask] == 0).all()


def test_group_advantages_and_kl_estimate():
    scores = torch.tensor([1.0, 2.0, 4.0, 0.0, 0.0, 3.0], dtype=torch.float64)
    got = losses.group_advantages(scores, 3, eps=1e-4)
    for g in range(2):
        xs = scores[3 * g:3 * g + 3].tolist()
        mean = sum(xs) / 3
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / 2)
        for i, x in enumerate(xs):
            assert got[3 * g + i].item() == pytest.approx((x - mean) / (std + 1e-4), rel=1e-5)
    with pytest.raises(ValueError, match="groups of 4"):
        losses.group_advantages(scores, 4)
    logp, ref = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    k3 = losses.kl_estimate(logp, ref)
    q = (ref - logp).flatten().tolist()
    assert k3.flatten().tolist() == pytest.approx([math.exp(x) - x - 1 for x in q], rel=1e-6)
    assert (k3 >= 0).all()
