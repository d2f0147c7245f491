"""Step 3's sampling: a sample's tokens depend on (seed, step, sample index) only, not on its batch."""

import torch

from polytrain.config import Config
from polytrain.distributed.materialize import materialize
from polytrain.models import ARCHITECTURES
from polytrain.models.registry import model_config, resolve_model
from polytrain.rlhf.rollout import Sampling, TrainingLayoutGeneration, lay_out


def _model():
    cfg = Config(model=model_config("llama", dim=32, n_layers=2, n_heads=4, n_kv_heads=0, ffn_dim=64,
                                    vocab_size=40, max_seq_len=32))
    resolve_model(cfg)
    with torch.device("meta"):
        model = ARCHITECTURES["llama"].build(cfg.model)
    materialize(model, torch.device("cpu"), seed=1)
    return model


def test_samples_do_not_depend_on_the_batch_they_share():
    generate = TrainingLayoutGeneration(_model(), Sampling(max_new_tokens=6, temperature=1.0), {0}, seed=9)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [5]]
    whole = generate(prompts, [0, 1, 2, 3], 3)
    # Two "ranks", each with half of the batch (other padding, other batch size).
    assert whole == generate(prompts[:2], [0, 1], 3) + generate(prompts[2:], [2, 3], 3)
    assert generate(prompts[::-1], [3, 2, 1, 0], 3) == whole[::-1]  # any order
    assert generate(prompts, [0, 1, 2, 3], 4) != whole  # another step, other samples
    # The layout: prompt, response, padding; the mask scores exactly the response tokens.
    roll = lay_out(prompts, whole, pad_id=0)
    assert roll.responses() == whole
    for b, p in enumerate(prompts):
        n, resp = roll.lengths[b].item(), whole[b]
        assert roll.ids[b, :len(p)].tolist() == p and roll.ids[b, len(p):n].tolist() == resp
        assert roll.mask[b].sum().item() == len(resp) == roll.response_lens[b].item()
        assert roll.mask[b].nonzero()[0].item() == len(p) - 1
    part = roll.rows(slice(1, 3))
    assert part.responses() == whole[1:3] and part.mask.shape == (2, roll.ids.shape[1] - 1)
