"""Pre-training objectives: BERT's masked LM and T5's span corruption, as the papers define them."""

from __future__ import annotations

import pytest
import torch

from polytrain.config import load_config
from polytrain.data.objectives import (
    MaskedLM,
    SpanCorruption,
    build_objective,
    reserved_ids,
    span_counts,
)
from polytrain.data.tokenizer import Tokenizer, train_bpe
from polytrain.errors import ConfigError

VOCAB = 500


def windows(n: int, length: int) -> torch.Tensor:
    # ids 1..399: never the [MASK] id or a sentinel (the top 30 ids)
    return torch.randint(1, 400, (n, length), generator=torch.Generator().manual_seed(0))


def test_masked_lm_scores_15_percent_with_80_10_10():
    mlm = MaskedLM(mask_id=VOCAB - 1, n_tokens=VOCAB - 1, fraction=0.15, seed=1)
    x = windows(400, 100)
    (corrupted,), labels = mlm.batch(x, x, range(400))
    scored = labels != -100
    assert (scored.sum(1) == 15).all()  # a fixed count per sequence
    assert torch.equal(labels[scored], x[scored]) and torch.equal(corrupted[~scored], x[~scored])
    masked = (corrupted == VOCAB - 1) & scored
    kept = (corrupted == x) & scored
    randomized = scored & ~masked & ~kept
    n = scored.sum().item()
    assert abs(masked.sum().item() / n - 0.8) < 0.02
    assert abs(kept.sum().item() / n - 0.1) < 0.02  # (a random draw of the same token counts as kept)
    assert abs(randomized.sum().item() / n - 0.1) < 0.02
    assert corrupted.max() < VOCAB


def test_masks_depend_on_the_sample_not_the_batch_or_layout():
    mlm = MaskedLM(mask_id=VOCAB - 1, n_tokens=VOCAB - 1, fraction=0.15, seed=1)
    x = windows(3, 64)
    (batch,), labels = mlm.batch(x, x, [10, 11, 12])
    (alone,), alone_labels = mlm.batch(x[1:2], x[1:2], [11])
    assert torch.equal(batch[1:2], alone) and torch.equal(labels[1:2], alone_labels)
    (other,), _ = mlm.batch(x[1:2], x[1:2], [12])
    assert not torch.equal(other, alone)
    (reseeded,), _ = MaskedLM(VOCAB - 1, VOCAB - 1, 0.15, seed=2).batch(x[1:2], x[1:2], [11])
    assert not torch.equal(reseeded, alone)


def test_span_corruption_cuts_spans_and_the_targets_restore_them():
    sentinels = [VOCAB - 1 - k for k in range(30)]
    span = SpanCorruption(sentinels, 0.15, 3.0, seed=1, eos_id=7)
    x = windows(50, 200)
    (enc, dec_in), targets = span.batch(x, x, range(50))
    noise, spans = span_counts(200, 0.15, 3.0)
    assert (noise, spans) == (30, 10)
    assert enc.shape == (50, 200 - noise + spans) and targets.shape == (50, noise + spans + 1)
    assert (targets[:, -1] == 7).all() and (dec_in[:, 0] == 0).all()  # ends with eos; starts from id 0
    assert torch.equal(dec_in[:, 1:], targets[:, :-1])  # the targets shifted right behind the start
    for row in range(50):
        e, t = enc[row].tolist(), targets[row, :-1].tolist()
        assert e.count(sentinels[0]) == 1 and e[-1] == sentinels[spans - 1]  # ends with the last cut
        pieces, restored = {}, []
        for tok in t:  # targets: sentinel k, then span k
            if tok in sentinels:
                pieces[tok] = []
                current = pieces[tok]
            else:
                current.append(tok)
        assert [len(p) for p in pieces.values()].count(0) == 0 and sum(map(len, pieces.values())) == noise
        for tok in e:
            restored += pieces[tok] if tok in sentinels else [tok]
        assert restored == x[row].tolist()
    # spans of mean length 3 and kept text between them: not one block
    assert len({tuple(enc[r].tolist()) for r in range(50)}) == 50


def test_special_ids_come_from_the_tokenizer_when_it_has_them(tmp_path):
    tok = train_bpe(["hello world " * 20], 300)
    tok.hf.add_special_tokens(["[MASK]"])
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    cfg = load_config(None, ["--model.arch", "bert", "--data.tokenizer", str(path)])
    assert reserved_ids(cfg) == 0
    assert build_objective(cfg, Tokenizer.load(path)).mask_id == tok.hf.token_to_id("[MASK]")
    plain = load_config(None, ["--model.arch", "bert"])
    assert reserved_ids(plain) == 1
    t5 = load_config(None, ["--model.arch", "t5", "--data.seq_len", "100"])
    assert reserved_ids(t5) == 5  # round(15 / 3) sentinels at the top of the vocabulary
    objective = build_objective(t5, tok)
    assert objective.sentinels == [t5.model.vocab_size - 1 - k for k in range(5)]


@pytest.mark.parametrize("args, message", [
    (["--model.arch", "bert", "--train.objective", "causal"], "train.objective = 'causal' does not fit bert"),
    (["--train.objective", "span"], "use 'causal' or 'auto'"),
    (["--data.mask_fraction", "1.5"], "data.mask_fraction = 1.5 must be in (0, 1)"),
])
def test_objective_must_fit_the_architecture(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, args)
