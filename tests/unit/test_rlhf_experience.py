"""Step 3's glue: experience from four models' outputs, and losses that move the actor the way the advantages say."""

import copy

import pytest
import torch

from polytrain.config import Config, RLHFConfig
from polytrain.distributed.materialize import materialize
from polytrain.models import ARCHITECTURES
from polytrain.models.registry import model_config, resolve_model
from polytrain.rlhf import losses
from polytrain.rlhf.experience import actor_loss, critic_loss, make_experience, sampled_entropy, sequence_kl
from polytrain.rlhf.rollout import Sampling, TrainingLayoutGeneration, lay_out


def _model(seed, head="lm"):
    cfg = Config(model=model_config("llama", dim=32, n_layers=2, n_heads=4, n_kv_heads=0, ffn_dim=64,
                                    vocab_size=40, max_seq_len=32, head=head))
    resolve_model(cfg)
    with torch.device("meta"):
        model = ARCHITECTURES["llama"].build(cfg.model)
    materialize(model, torch.device("cpu"), seed=seed)
    return model


def _logprobs(model, ids):
    return losses.token_logprobs(model(ids[:, :-1]), ids[:, 1:])


@pytest.fixture(scope="module")
def setup():
    actor = _model(1)
    models = dict(actor=actor, reference=copy.deepcopy(actor), reward=_model(2, "value"), critic=_model(3, "value"))
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]  # GRPO groups of 2: one prompt each
    responses = TrainingLayoutGeneration(actor, Sampling(max_new_tokens=5), {0}, seed=4)(prompts, [0, 1, 2, 3], 0)
    return models, lay_out(prompts, responses, pad_id=0)


def _experience(models, roll, settings):
    with torch.no_grad():
        ids = roll.ids
        scores = losses.end_scores(models["reward"](ids), roll.lengths)
        values = models["critic"](ids)[:, :-1] if settings.algorithm == "ppo" else None
        return make_experience(roll, _logprobs(models["actor"], ids), _logprobs(models["reference"], ids),
                               scores, values, settings)


def test_ppo_experience_and_losses(setup):
    models, roll = setup
    exp = _experience(models, roll, RLHFConfig())
    mask = roll.mask
    assert torch.equal(exp.old_logprobs, exp.ref_logprobs)  # the reference starts as the actor
    assert sequence_kl(exp).abs().max() == 0
    scores = losses.end_scores(models["reward"](roll.ids), roll.lengths)
    torch.testing.assert_close(exp.scores, scores.clamp(-5, 5))
    torch.testing.assert_close(exp.returns, (exp.advantages + exp.old_values) * mask)
    assert (exp.advantages[~mask] == 0).all() and (exp.advantages[mask] != 0).any()
    want_entropy = -(exp.old_logprobs * mask).sum() / mask.sum()
    torch.testing.assert_close(sampled_entropy(exp), want_entropy)
    count = float(mask.sum())
    loss, stats = actor_loss(_logprobs(models["actor"], roll.ids), exp, RLHFConfig(), count)
    # On-policy, ratio 1: the surrogate is -mean(A) and nothing is clipped.
    assert loss.item() == pytest.approx(-losses.masked_mean(exp.advantages, mask).item(), rel=1e-4, abs=1e-6)
    assert stats["clip_frac"].item() == 0
    value = critic_loss(models["critic"](roll.ids)[:, :-1], exp, RLHFConfig(), count)
    want = 0.5 * losses.masked_mean((exp.old_values - exp.returns) ** 2, mask)
    assert value.item() == pytest.approx(want.item(), rel=1e-4)
    # Rows split into two halves, each over the whole batch's count: the parts add up to the whole.
    halves = [actor_loss(_logprobs(models["actor"], roll.ids[s]), exp.rows(s), RLHFConfig(), count)[0]
              for s in (slice(0, 2), slice(2, 4))]
    assert (halves[0] + halves[1]).item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)


def test_a_step_raises_the_likelihood_of_advantaged_tokens(setup):
    models, roll = setup
    actor = copy.deepcopy(models["actor"])
    exp = _experience({**models, "actor": actor}, roll, RLHFConfig())
    opt = torch.optim.SGD(actor.parameters(), lr=0.5)
    loss, _ = actor_loss(_logprobs(actor, roll.ids), exp, RLHFConfig(), float(roll.mask.sum()))
    loss.backward()
    opt.step()
    with torch.no_grad():
        new = _logprobs(actor, roll.ids)
    change = ((new - exp.old_logprobs) * exp.advantages)[roll.mask].sum()
    assert change > 0  # first-order: the step moves log pi along the advantages


def test_grpo_experience_normalises_within_groups(setup):
    models, roll = setup
    settings = RLHFConfig(algorithm="grpo", group_size=2)
    exp = _experience(models, roll, settings)
    per_sample = torch.stack([exp.advantages[b][roll.mask[b]][0] for b in range(4)])  # one value per row
    assert torch.allclose(per_sample.view(2, 2).sum(1), torch.zeros(2), atol=1e-5)
    for b in range(4):  # every response token carries its sample's advantage
        assert torch.allclose(exp.advantages[b][roll.mask[b]], per_sample[b])
    loss, stats = actor_loss(_logprobs(models["actor"], roll.ids), exp, settings, float(roll.mask.sum()))
    assert stats["kl_loss"].item() == pytest.approx(0.0, abs=1e-6)  # the actor is still the reference
    assert exp.old_values is None
