"""Corpora, the train/val split, packed token files, TokenDataset and the prepare cache."""

import json
import multiprocessing as mp
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from polytrain.config import DataConfig
from polytrain.data import (
    Document,
    TokenDataset,
    Tokenizer,
    load_prepared,
    open_corpus,
    plan_split,
    prepare,
    prepare_corpus,
    train_bpe,
)
from polytrain.data import cache as cache_mod
from polytrain.data import corpus as corpus_mod
from polytrain.data.packed import token_dtype
from polytrain.data.split import hashed_to_val, split_tokens
from polytrain.errors import ConfigError

WORDS = "alpha beta gamma delta tokens model layer loss step rank shard batch".split()


def doc_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(n)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(doc_texts(200), 320)


# --- corpora ---------------------------------------------------------------------------

def test_missing_source(tmp_path):
    with pytest.raises(ConfigError, match=f"^data.source: {tmp_path / 'x.txt'} does not exist$"):
        open_corpus(str(tmp_path / "x.txt"))


def test_unsupported_suffix(tmp_path):
    (tmp_path / "d.csv").write_text("a,b")
    with pytest.raises(ConfigError, match=r"unsupported kind '\.csv'.*\.txt.*\.jsonl.*\.bin"):
        open_corpus(str(tmp_path / "d.csv"))
    (tmp_path / "d.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="is already tokenized"):
        open_corpus(str(tmp_path / "d.bin"))


def test_jsonl_documents_and_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": ""}\n{"text": "four", "x": 1}\n')
    docs = list(open_corpus(str(path)).documents())
    # The blank line 2 and the empty document on line 3 are skipped.
    assert docs == [Document("c.jsonl:1", "one"), Document("c.jsonl:4", "four")]
    path.write_text('{"text": "ok"}\n{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ConfigError, match='line 3 has no string field "text"'):
        list(open_corpus(str(path)).documents())
    path.write_text('{"text": "ok"}\n{"text": 5}\n')
    with pytest.raises(ConfigError, match='line 2 has no string field "text"'):
        list(open_corpus(str(path)).documents())
    path.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        list(open_corpus(str(path)).documents())


def test_txt_chunks_at_blank_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "CHUNK_CHARS", 50)
    paragraphs = [" ".join(doc_texts(1, seed=i)[0].split()[:8]) for i in range(12)]
    text = "\r\n".join(paragraphs) + "\n\n" + "\n\n\n".join(paragraphs) + "\n"
    path = tmp_path / "book.txt"
    path.write_bytes(text.encode())
    docs = list(open_corpus(str(path)).documents())
    assert "".join(d.text for d in docs) == text  # nothing lost or altered, CRLF kept
    assert [d.name for d in docs] == [f"book.txt#{i}" for i in range(len(docs))]
    assert len(docs) > 3
    for d in docs[:-1]:
        assert len(d.text) >= 50 and d.text.endswith("\n\n")


def test_directory_source(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.txt").write_text("bee")
    write_jsonl(tmp_path / "a.jsonl", ["ay", "ay2"])
    (tmp_path / "ignored.md").write_text("no")
    docs = list(open_corpus(str(tmp_path)).documents())
    assert docs == [
        Document("a.jsonl:1", "ay"), Document("a.jsonl:2", "ay2"), Document("b/x.txt#0", "bee")
    ]


def test_stdlib_listing():
    files = corpus_mod._stdlib_files()
    names = [n for n, _ in files]
    assert len(names) > 1000 and "json/decoder.py" in names
    assert not any("site-packages" in n or "dist-packages" in n for n in names)
    assert all(n.endswith(".py") and not n.startswith("/") for n in names)
    assert corpus_mod._stdlib_files() == files
    assert open_corpus("stdlib").identity == open_corpus("stdlib").identity


def test_identity_changes_with_file(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", ["a"])
    before = open_corpus(str(path)).identity
    write_jsonl(path, ["a", "bb"])
    assert open_corpus(str(path)).identity != before


# --- split -----------------------------------------------------------------------------

def test_hash_rule():
    names = [f"doc{i}" for i in range(2000)]
    val = [n for n in names if hashed_to_val(n, 0.1)]
    assert val == [n for n in names if zlib.crc32(n.encode()) % 10000 < 1000]
    assert 150 < len(val) < 250


def test_split_never_empty():
    docs = [Document(f"d{i}", "x") for i in range(3)]
    rare = 0.0005
    assert not any(hashed_to_val(d.name, rare) for d in docs)
    split = plan_split(docs, rare)
    assert [split.is_val(d.name) for d in docs] == [False, False, True]  # last moved to val
    assert split.train_chars == 2
    split = plan_split(docs, 0.99999)
    assert [split.is_val(d.name) for d in docs] == [False, True, True]  # first kept in train
    split = plan_split(docs, 0.0)
    assert not any(split.is_val(d.name) for d in docs)
    one = plan_split([Document("only", "abcdefghij")], 0.2)
    assert one.by_position and not one.is_val("only") and one.train_chars == 8
    assert split_tokens(100, 0.02) == 2
    assert split_tokens(10, 0.001) == 1 and split_tokens(2, 0.9) == 1
    with pytest.raises(ConfigError, match="no documents"):
        plan_split([], 0.1)


# --- prepare / load --------------------------------------------------------------------

def test_token_dtype():
    assert token_dtype(300) == np.dtype("<u2") and token_dtype(65536) == np.dtype("<u2")
    assert token_dtype(65537) == np.dtype("<u4")


def test_prepare_jsonl(tmp_path, tok):
    texts = doc_texts(300)
    src = write_jsonl(tmp_path / "c.jsonl", texts)
    out = tmp_path / "out" / "c.bin"
    p = prepare(str(src), tok, out, 0.1)
    names = [f"c.jsonl:{i + 1}" for i in range(len(texts))]
    split = plan_split([Document(n, t) for n, t in zip(names, texts)], 0.1)
    want = {True: [], False: []}
    for name, text in zip(names, texts):
        want[split.is_val(name)] += tok.encode(text) + [tok.eot_id]
    train = np.fromfile(p.train_path, dtype="<u2")
    val = np.fromfile(p.val_path, dtype="<u2")
    assert train.tolist() == want[False] and val.tolist() == want[True]
    assert (p.n_train_tokens, p.n_val_tokens) == (len(want[False]), len(want[True]))
    assert 10 < sum(map(split.is_val, names)) < 60
    assert p.dtype == np.dtype("<u2") and p.val_path == out.with_suffix(".val.bin")
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["train"]["tokens"] == p.n_train_tokens and meta["val"]["tokens"] == p.n_val_tokens
    assert meta["dtype"] == "<u2" and meta["split"] == "document"
    assert sorted(f.name for f in out.parent.iterdir()) == [
        "c.bin", "c.json", "c.tokenizer.json", "c.val.bin"]  # and no temp files
    again = load_prepared(out)
    assert again.tokenizer.fingerprint == tok.fingerprint
    assert (again.n_train_tokens, again.n_val_tokens) == (p.n_train_tokens, p.n_val_tokens)
    assert again.dtype == p.dtype


def test_prepare_single_document_splits_by_position(tmp_path, tok):
    text = " ".join(doc_texts(50))
    src = tmp_path / "one.txt"
    src.write_text(text)
    p = prepare(str(src), tok, tmp_path / "one.bin", 0.1)
    all_ids = tok.encode(text) + [tok.eot_id]
    n_val = split_tokens(len(all_ids), 0.1)
    assert p.n_val_tokens == n_val > 0
    train = np.fromfile(p.train_path, dtype="<u2").tolist()
    val = np.fromfile(p.val_path, dtype="<u2").tolist()
    assert train + val == all_ids and len(val) == n_val


def test_prepare_val_fraction_zero(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", doc_texts(20))
    p = prepare(str(src), tok, tmp_path / "c.bin", 0.0)
    assert p.n_val_tokens == 0 and p.val_path.stat().st_size == 0 and p.n_train_tokens > 0


def test_load_prepared_errors(tmp_path, tok):
    lone = tmp_path / "lone.bin"
    lone.write_bytes(b"\0\0")
    with pytest.raises(ConfigError, match=r"not a polytrain prepared file: missing lone\.json; "
                                          r"create it with `polytrain prepare`"):
        load_prepared(lone)
    src = write_jsonl(tmp_path / "c.jsonl", doc_texts(20))
    p = prepare(str(src), tok, tmp_path / "c.bin", 0.1)
    with open(p.train_path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ConfigError, match="missing or truncated"):
        load_prepared(tmp_path / "c.bin")


# --- TokenDataset ----------------------------------------------------------------------

def test_token_dataset_windows(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(23, dtype="<u2").tofile(path)
    ds = TokenDataset(path, "<u2", 5)
    assert len(ds) == 4  # (23 - 1) // 5
    x, y = ds.get_batch([3, 0])
    assert x.dtype == torch.long and x.shape == y.shape == (2, 5)
    assert x.tolist() == [[15, 16, 17, 18, 19], [0, 1, 2, 3, 4]]
    assert y.tolist() == [[16, 17, 18, 19, 20], [1, 2, 3, 4, 5]]
    with pytest.raises(IndexError):
        ds.get_batch([4])


def test_token_dataset_uint32(tmp_path):
    path = tmp_path / "t.bin"
    np.array([70000, 1, 70001], dtype="<u4").tofile(path)
    x, y = TokenDataset(path, np.dtype("<u4"), 2).get_batch([0])
    assert x.tolist() == [[70000, 1]] and y.tolist() == [[1, 70001]]


def test_token_dataset_too_small(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(8, dtype="<u2").tofile(path)
    with pytest.raises(ConfigError, match="holds 8 tokens.*seq_len = 8.*must be smaller than 8"):
        TokenDataset(path, "<u2", 8)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds 0 tokens"):
        TokenDataset(tmp_path / "empty.bin", "<u2", 4)


# --- prepare_corpus (cache) ------------------------------------------------------------

def test_prepare_corpus_caches(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "c.jsonl", doc_texts(200))
    cfg = DataConfig(source=str(src), val_fraction=0.1)
    first = prepare_corpus(cfg, 300, tmp_path / "cache")
    assert first.tokenizer.vocab_size <= 300 and first.tokenizer.eot_id == 0
    assert first.train_path.parent == tmp_path / "cache" / "tokens"

    def boom(*a, **k):
        raise AssertionError("cache miss: work repeated")
    monkeypatch.setattr(cache_mod, "prepare", boom)
    monkeypatch.setattr(cache_mod, "train_bpe", boom)
    second = prepare_corpus(cfg, 300, tmp_path / "cache")
    assert (second.train_path, second.n_train_tokens, second.n_val_tokens) == (
        first.train_path, first.n_train_tokens, first.n_val_tokens)
    assert second.tokenizer.fingerprint == first.tokenizer.fingerprint
    with pytest.raises(AssertionError, match="cache miss"):  # a new vocab size is a new entry
        prepare_corpus(cfg, 310, tmp_path / "cache")


def test_cache_dir_from_env(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "c.jsonl", doc_texts(30))
    monkeypatch.setenv("POLYTRAIN_CACHE", str(tmp_path / "envcache"))
    p = prepare_corpus(DataConfig(source=str(src)), 300)
    assert p.train_path.is_relative_to(tmp_path / "envcache")


def test_stale_cache_entry_is_rebuilt(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", doc_texts(50))
    cfg = DataConfig(source=str(src))
    p = prepare_corpus(cfg, 300, tmp_path / "cache")
    p.train_path.write_bytes(b"\0\0")  # as if truncated by a crash
    again = prepare_corpus(cfg, 300, tmp_path / "cache")
    assert again.train_path.stat().st_size == 2 * again.n_train_tokens == 2 * p.n_train_tokens


def test_prepared_bin_as_source(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", doc_texts(40))
    p = prepare(str(src), tok, tmp_path / "c.bin", 0.1)
    got = prepare_corpus(DataConfig(source=str(tmp_path / "c.bin")), 512, tmp_path / "cache")
    assert (got.train_path, got.n_train_tokens) == (p.train_path, p.n_train_tokens)
    n = tok.vocab_size
    with pytest.raises(ConfigError, match=f"has {n} tokens but model.vocab_size = 290; "
                                          f"set model.vocab_size >= {n}"):
        prepare_corpus(DataConfig(source=str(tmp_path / "c.bin")), 290, tmp_path / "cache")
    with pytest.raises(ConfigError, match="missing nope.json"):
        (tmp_path / "nope.bin").write_bytes(b"")
        prepare_corpus(DataConfig(source=str(tmp_path / "nope.bin")), 512, tmp_path / "cache")


def test_user_tokenizer_json(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", doc_texts(40))
    tok.save(tmp_path / "tokenizer.json")
    cfg = DataConfig(source=str(src), tokenizer=str(tmp_path / "tokenizer.json"))
    p = prepare_corpus(cfg, 1000, tmp_path / "cache")
    assert p.tokenizer.fingerprint == tok.fingerprint
    with pytest.raises(ConfigError, match=f"set model.vocab_size >= {tok.vocab_size}"):
        prepare_corpus(cfg, 100, tmp_path / "cache")
    cfg.tokenizer = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="data.tokenizer: .*missing.json does not exist"):
        prepare_corpus(cfg, 1000, tmp_path / "cache")


def test_stdlib_source_end_to_end(tmp_path, monkeypatch):
    # A slice of the stdlib keeps this fast; the full corpus takes ~40 s on 2 cores.
    files = corpus_mod._stdlib_files()
    some = [f for f in files if f[0].startswith("json/")]
    monkeypatch.setattr(corpus_mod, "_stdlib_files", lambda: some)
    p = prepare_corpus(DataConfig(source="stdlib", val_fraction=0.2), 400, tmp_path / "cache")
    assert p.train_path.name.startswith("stdlib-")
    assert p.n_train_tokens > 0 and p.n_val_tokens > 0
    text = p.tokenizer.decode(np.fromfile(p.train_path, dtype=p.dtype).tolist())
    split = plan_split([Document(name, path.read_text()) for name, path in some], 0.2)
    docs = [path.read_text() for name, path in some if not split.is_val(name)]
    assert text == "<|endoftext|>".join(docs) + "<|endoftext|>"


def _prepare_in_child(src: str, cache: str, queue) -> None:
    p = prepare_corpus(DataConfig(source=src), 300, Path(cache))
    queue.put((str(p.train_path), p.n_train_tokens, p.tokenizer.fingerprint))


def test_concurrent_prepare_is_safe(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", doc_texts(400))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=(str(src), str(tmp_path / "cache"), queue))
             for _ in range(2)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0
    assert results[0] == results[1]
    p = load_prepared(results[0][0])
    assert p.train_path.stat().st_size == 2 * p.n_train_tokens
    leftovers = [f for f in (tmp_path / "cache").rglob("*") if f.name.endswith(".tmp")]
    assert leftovers == []
