"""Parquet, Arrow and Hugging Face Datasets as data.source: the same tokens as the same texts in
.jsonl, read in bounded slices, with data.text_field naming the column."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from polytrain.data import open_corpus, prepare, train_bpe
from polytrain.data import packed as packed_mod
from polytrain.data import tabular
from polytrain.errors import ConfigError

pa = pytest.importorskip("pyarrow", reason="pyarrow (polytrain[datasets]) reads .parquet / .arrow sources")
import pyarrow.ipc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

WORDS = "alpha beta gamma delta tokens model layer loss step rank shard batch".split()


def texts(n: int) -> list[str]:
    rng = random.Random(3)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(n)]


def write_formats(root: Path, rows: list[str | None], column: str = "text") -> dict[str, Path]:
    """The same rows as .jsonl (the reference, written by hand), .parquet and .arrow (both IPC layouts)."""
    root.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": root / "c.jsonl", "parquet": root / "c.parquet",
             "arrow_stream": root / "stream.arrow", "arrow_file": root / "file.arrow"}
    paths["jsonl"].write_text("".join(json.dumps({column: r or ""}) + "\n" for r in rows))
    table = pa.table({"id": list(range(len(rows))), column: rows})
    pq.write_table(table, paths["parquet"], row_group_size=7)
    with pa.ipc.new_stream(paths["arrow_stream"], table.schema) as w:
        w.write_table(table, max_chunksize=5)
    with pa.ipc.new_file(paths["arrow_file"], table.schema) as w:
        w.write_table(table, max_chunksize=5)
    return paths


@pytest.fixture(scope="module")
def tok():
    return train_bpe(texts(100), 300)


def tokens_of(source: Path | str, tok, out: Path, text_field: str = "text") -> bytes:
    # val_fraction 0: every document in train, so the split (which hashes names that differ
    # between formats) does not enter the comparison.
    prepared = prepare(str(source), tok, out, 0.0, text_field)
    assert prepared.n_val_tokens == 0
    return prepared.train_path.read_bytes()


def test_every_format_gives_the_tokens_of_jsonl(tmp_path, tok):
    rows = texts(40)
    rows[3] = None  # a null text is an empty document: skipped, as an empty .jsonl text is
    paths = write_formats(tmp_path / "src", rows, column="body")
    reference = tokens_of(paths["jsonl"], tok, tmp_path / "ref.bin", "body")
    assert len(reference) > 1000
    for kind in ("parquet", "arrow_stream", "arrow_file"):
        assert tokens_of(paths[kind], tok, tmp_path / f"{kind}.bin", "body") == reference, kind
    docs = list(open_corpus(str(paths["parquet"]), "body").documents())
    assert [d.name for d in docs[:4]] == ["c.parquet:1", "c.parquet:2", "c.parquet:3", "c.parquet:5"]


def test_directory_mixes_formats(tmp_path):
    write_formats(tmp_path, ["one", "two"])
    kinds = {d.name.split(":")[0] for d in open_corpus(str(tmp_path)).documents()}
    assert kinds == {"c.jsonl", "c.parquet", "stream.arrow", "file.arrow"}


def test_a_source_larger_than_one_slice_streams(tmp_path, tok, monkeypatch):
    """40 rows, 4 at a time: the reader never holds more, and prepare encodes batch by batch."""
    monkeypatch.setattr(tabular, "READ_ROWS", 4)
    monkeypatch.setattr(packed_mod, "BATCH_CHARS", 500)
    paths = write_formats(tmp_path / "src", texts(40))
    slices: list[int] = []
    real_slices = tabular.record_slices

    def counted(path, field):
        for values in real_slices(path, field):
            slices.append(len(values))
            yield values

    encodes: list[int] = []
    real_encode = tok.encode_batch
    monkeypatch.setattr(tabular, "record_slices", counted)
    monkeypatch.setattr(tok, "encode_batch", lambda batch: encodes.append(len(batch)) or real_encode(batch))
    streamed = tokens_of(paths["parquet"], tok, tmp_path / "p.bin")
    # Two passes (split, tokens), each in slices of at most 4 rows of 7-row groups: 4 + 3 + ...
    assert max(slices) <= 4 and sum(slices) == 2 * 40 and len(slices) >= 2 * 10
    assert len(encodes) > 3 and sum(encodes) == 40  # tokens written in several batches
    monkeypatch.setattr(tok, "encode_batch", real_encode)
    assert streamed == tokens_of(paths["jsonl"], tok, tmp_path / "j.bin")


def test_text_field_errors(tmp_path):
    paths = write_formats(tmp_path, ["a", "b"])
    for kind in ("parquet", "arrow_file"):
        with pytest.raises(ConfigError, match=r"data.text_field: .* has no column 'body' \(columns: id, text\)"):
            list(open_corpus(str(paths[kind]), "body").documents())
        with pytest.raises(ConfigError, match=r"row 1 of .* has a int in column 'id', not text"):
            list(open_corpus(str(paths[kind]), "id").documents())
    with pytest.raises(ConfigError, match='line 1 has no string field "body"'):
        list(open_corpus(str(paths["jsonl"]), "body").documents())
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="is not a Parquet file"):
        list(open_corpus(str(tmp_path / "bad.parquet")).documents())


def test_hf_source_syntax():
    assert tabular.parse_hf_source("hf:user/set") == ("user/set", None, "train")
    assert tabular.parse_hf_source("hf:user/set:validation") == ("user/set", None, "validation")
    assert tabular.parse_hf_source("hf:wikitext:wikitext-2-raw-v1:test") == ("wikitext", "wikitext-2-raw-v1", "test")
    for bad in ("hf:", "hf:a::b", "hf:a:b:c:d"):
        with pytest.raises(ConfigError, match="is not hf:NAME"):
            tabular.parse_hf_source(bad)


def test_hf_datasets_give_the_tokens_of_jsonl(tmp_path, tok, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="hf: sources need the datasets package (polytrain[datasets])")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # never a download: every source below is local
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    datasets.disable_progress_bars()
    rows = texts(30)
    data_dir = tmp_path / "files"
    write_formats(data_dir, rows)
    for p in data_dir.iterdir():
        if p.suffix != ".jsonl":
            p.unlink()
    reference = tokens_of(data_dir / "c.jsonl", tok, tmp_path / "ref.bin")
    # A directory of data files, read by datasets.load_dataset (its builder picks the json loader).
    assert tokens_of(f"hf:{data_dir}", tok, tmp_path / "dir.bin") == reference
    # A dataset written by save_to_disk, its split named.
    saved = tmp_path / "saved"
    datasets.DatasetDict({"validation": datasets.load_dataset(str(data_dir), split="train")}).save_to_disk(saved)
    assert tokens_of(f"hf:{saved}:validation", tok, tmp_path / "saved.bin") == reference
    with pytest.raises(ConfigError, match="has no split 'train'"):
        open_corpus(f"hf:{saved}")
    with pytest.raises(ConfigError, match="has no column 'body'"):
        open_corpus(f"hf:{saved}:validation", "body")
