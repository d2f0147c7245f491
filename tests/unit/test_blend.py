"""Weighted blending: exact counts, every sample once per pass, order independent of the layout, resumable."""

import numpy as np
import pytest
import torch

from polytrain.data import GlobalBatchSampler, TokenDataset
from polytrain.data.blend import Blend, Source, TokenBlend, blend_counts, parse_sources
from polytrain.errors import ConfigError


def test_counts_follow_the_weights_exactly():
    assert blend_counts([0.7, 0.3], 10) == [7, 3]
    assert blend_counts([1, 1, 1], 10) == [4, 3, 3]  # remainder to the earliest tie
    assert blend_counts([2, 0, 1], 7) == [5, 0, 2]  # 4.67, 0, 2.33: largest remainder wins
    assert sum(blend_counts([0.123, 0.456, 0.421], 997)) == 997


def test_blend_draws_each_sample_once_per_pass():
    blend = Blend(sizes=[5, 20], weights=[0.5, 0.5], seed=7)  # 25 samples: 13 from a 5-sample set
    assert blend.counts == [13, 12] and len(blend) == 25
    located = [blend.locate(i) for i in range(25)]
    small = [j for d, j in located if d == 0]
    assert sorted(small[:5]) == sorted(small[5:10]) == list(range(5))  # two full passes, then 3 more
    assert small[:5] != small[5:10]  # each pass in its own order
    big = [j for d, j in located if d == 1]
    assert len(set(big)) == 12 and all(0 <= j < 20 for j in big)  # a subset, no repeats
    assert Blend([5, 20], [0.5, 0.5], seed=7).locate(17) == blend.locate(17)  # pure function
    assert [Blend([5, 20], [0.5, 0.5], seed=8).locate(i) for i in range(25)] != located
    with pytest.raises(IndexError):
        blend.locate(25)


def test_bad_weights_and_sources_are_one_line_each():
    with pytest.raises(ConfigError, match="sum to a positive number"):
        Blend([3, 4], [0, 0], seed=0)
    with pytest.raises(ConfigError, match="finite and >= 0"):
        Blend([3, 4], [1, -1], seed=0)
    with pytest.raises(ConfigError, match="b.bin holds no samples"):
        Blend([3, 0], [1, 1], seed=0, names=["a.bin", "b.bin"])
    assert len(Blend([3, 0], [1, 0], seed=0)) == 3  # an empty source of weight 0 is fine


def test_parse_sources_from_toml_tables_and_text():
    toml = [{"path": "a.bin", "weight": 3}, {"path": "b.bin"}]
    assert parse_sources(toml, "data.sources") == [Source("a.bin", 3.0), Source("b.bin", 1.0)]
    assert parse_sources("a.bin:0.25, C:/x/b.bin", "data.sources") == [Source("a.bin", 0.25),
                                                                      Source("C:/x/b.bin", 1.0)]
    with pytest.raises(ConfigError, match="data.sources: each entry is a table"):
        parse_sources([{"path": "a", "wieght": 1}], "data.sources")
    with pytest.raises(ConfigError, match="weight of a must be a number"):
        parse_sources([{"path": "a", "weight": "x"}], "data.sources")
    with pytest.raises(ConfigError, match="must sum to a positive number"):
        parse_sources("a:0,b:0", "data.sources")
    with pytest.raises(ConfigError, match="names no sources"):
        parse_sources("", "data.sources")


def _token_file(tmp_path, name, start, n):
    path = tmp_path / name
    np.arange(start, start + n, dtype="<u2").tofile(path)
    return TokenDataset(path, "<u2", seq_len=4)


def test_token_blend_order_is_the_same_for_every_layout_and_resumes(tmp_path):
    # Windows of dataset a start with tokens < 1000, of b with tokens >= 1000: the source shows.
    a, b = _token_file(tmp_path, "a.bin", 0, 41), _token_file(tmp_path, "b.bin", 1000, 81)  # 10 and 20 windows
    data = TokenBlend([a, b], [3, 1], seed=5, names=["a.bin", "b.bin"])
    assert len(data) == 30 and data.blend.counts == [23, 7]  # a upsampled, b subsampled

    def stream(dp_size, steps, state=None):
        out = []
        samplers = [GlobalBatchSampler(len(data), 6, 11, r, dp_size) for r in range(dp_size)]
        for s in samplers:
            if state:
                s.load_state_dict(state)
        for _ in range(steps):
            rows = [data.get_batch(s.next_batch())[0] for s in samplers]  # each rank's (B/dp, 4) inputs
            out.append(torch.cat(rows))
        return out, samplers[0].state_dict()

    one, _ = stream(1, 8)
    two, _ = stream(2, 8)
    for x, y in zip(one, two):
        assert torch.equal(x, y)  # step k's global batch does not depend on the world size
    from_a = sum(int((x[:, 0] < 1000).sum()) for x in one[:5])  # 5 steps x 6 = one epoch of 30
    assert from_a == 23
    first, state = stream(2, 3)
    rest, _ = stream(1, 5, state)  # resume at another world size
    assert all(torch.equal(x, y) for x, y in zip(first + rest, one))
    inputs, targets = data.get_batch([0, 29])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # windows keep their shift


def test_token_blend_needs_one_sequence_length(tmp_path):
    a = _token_file(tmp_path, "a.bin", 0, 41)
    c = TokenDataset(tmp_path / "a.bin", "<u2", seq_len=8)
    with pytest.raises(ConfigError, match="different sequence lengths"):
        TokenBlend([a, c], [1, 1], seed=0)


def _texts(tmp_path, name, word, n):
    import json

    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": f"{word} {i} " * 30}) + "\n" for i in range(n)))
    return str(path)


def test_prepare_blend_tokenizes_every_source_with_one_tokenizer(tmp_path):
    from polytrain.config import DataConfig
    from polytrain.data import prepare_to
    from polytrain.data.blended import prepare_blend

    cfg = DataConfig(seq_len=16, val_fraction=0.2)
    a, b = _texts(tmp_path, "a.jsonl", "alpha", 20), _texts(tmp_path, "b.jsonl", "omega", 20)
    corpus = prepare_blend([Source(a, 3.0), Source(b, 1.0)], cfg, 300, seed=0, cache_dir=tmp_path / "cache")
    fingerprints = {p.tokenizer.fingerprint for p in corpus.parts}
    assert len(fingerprints) == 1  # one BPE trained on both
    tok = corpus.tokenizer
    drawn = corpus.train.get_batch(range(len(corpus.train)))[0]
    alpha = sum("alpha" in tok.decode(row) for row in drawn)
    counts = corpus.train.blend.counts
    assert alpha == counts[0] and counts[0] == round(0.75 * sum(counts))  # 3:1
    assert len(corpus.val) > 0
    # Prepared .bin files bring their tokenizer; a text source is tokenized with it.
    out = tmp_path / "a.bin"
    prepare_to(a, out, vocab_size=300, val_fraction=0.2, cache_dir=tmp_path / "cache")
    mixed = prepare_blend([Source(str(out)), Source(b)], cfg, 300, seed=0, cache_dir=tmp_path / "cache")
    assert {p.tokenizer.fingerprint for p in mixed.parts} == {load_fp(out)}
    other = tmp_path / "b.bin"
    prepare_to(b, other, vocab_size=290, val_fraction=0.2, cache_dir=tmp_path / "cache")  # another BPE
    with pytest.raises(ConfigError, match="is not the tokenizer .*b.bin was prepared with"):
        prepare_blend([Source(str(out)), Source(str(other))], cfg, 300, seed=0, cache_dir=tmp_path / "cache")


def load_fp(path):
    from polytrain.data import load_prepared

    return load_prepared(path).tokenizer.fingerprint
