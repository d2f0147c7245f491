"""Step 3's sampling: a sample's tokens depend on (seed, step, sample index) only, not on its batch."""

import torch

from polytrain.config import Config
from polytrain.models.registry import model_config, resolve_model
from polytrain.distributed.materialize import materialize
from polytrain.models import ARCHITECTURES
from polytrain.rlhf.rollout import Sampling, rollout


def _model():
    cfg = Config(model=model_config("llama", dim=32, n_layers=2, n_heads=4, n_kv_heads=0, ffn_dim=64,
                                    vocab_size=40, max_seq_len=32))
    resolve_model(cfg)
    with torch.device("meta"):
        model = ARCHITECTURES["llama"].build(cfg.model)
    materialize(model, torch.device("cpu"), seed=1)
    return model


def test_samples_do_not_depend_on_the_batch_they_share():
    model = _model()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [5]]
    args = dict(step=3, seed=9, sampling=Sampling(max_new_tokens=6, temperature=1.0), stop_tokens={0}, pad_id=0)
    whole = rollout(model, prompts, [0, 1, 2, 3], **args)
    # Two "ranks", each with half of the batch (other padding, other batch size).
    halves = [rollout(model, prompts[:2], [0, 1], **args), rollout(model, prompts[2:], [2, 3], **args)]
    assert whole.responses() == halves[0].responses() + halves[1].responses()
    again = rollout(model, prompts[::-1], [3, 2, 1, 0], **args)  # any order
    assert again.responses() == whole.responses()[::-1]
    other_step = rollout(model, prompts, [0, 1, 2, 3], **{**args, "step": 4})
    assert other_step.responses() != whole.responses()
    # The layout: prompt, response, padding; the mask scores exactly the response tokens.
    for b, p in enumerate(prompts):
        n, resp = whole.lengths[b].item(), whole.responses()[b]
        assert whole.ids[b, :len(p)].tolist() == p and whole.ids[b, len(p):n].tolist() == resp
        assert whole.mask[b].sum().item() == len(resp) == whole.response_lens[b].item()
        assert whole.mask[b].nonzero()[0].item() == len(p) - 1


def test_ranks_agree_when_to_stop():
    model = _model()
    calls = []

    def all_done(local):  # another rank still decoding: keep going
        calls.append(local)
        return False

    out = rollout(model, [[5, 6]], [0], step=0, seed=0, sampling=Sampling(max_new_tokens=5, temperature=0),
                  stop_tokens=set(range(40)), pad_id=0, all_done=all_done)
    assert calls[0] is True  # this rank's row ended at its first token ...
    assert len(calls) == 4 and out.response_lens.item() == 1  # ... but decoding ran all 5 steps
