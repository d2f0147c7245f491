"""Column stores as document sources: Parquet and Arrow files, and Hugging Face Datasets.

    data.source = "corpus.parquet"            # pyarrow's batch reader: at most a row group's column
    data.source = "shard-00000.arrow"         # Arrow IPC (what datasets writes), memory-mapped
    data.source = "hf:PATH_OR_NAME[:CONFIG][:SPLIT]"   # via the `datasets` package

Each row is one document: its string column `data.text_field` ("text" by default); its name
is '<file>:<row>' (rows counted from 1, as .jsonl lines are) or 'hf:<name>/<split>:<row>'.
Rows are read READ_ROWS at a time and only the text column, so a corpus larger than memory
streams: `prepare` (packed.py) turns the documents into token files batch by batch and never
holds more than a slice of the source. An `hf:` name is first tried as a directory written by
`Dataset.save_to_disk` / `DatasetDict.save_to_disk`, else given to `datasets.load_dataset`,
which reads local data files or the user's Hugging Face cache (and downloads only what is in
neither, as `datasets` does); both memory-map the Arrow data instead of loading it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError

READ_ROWS = 1024
"""Rows read at a time: a slice of a row group, so memory stays bounded by the longest rows."""
HF_PREFIX = "hf:"
_INSTALL = "pip install 'polytrain[datasets]'"


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401  (submodules the readers use)
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError(f"data.source: reading .parquet / .arrow files needs pyarrow; {_INSTALL}") from None
    return pyarrow


def _column_slices(batches: Iterator[Any], field: str, where: str) -> Iterator[list[Any]]:
    """The `field` column of each record batch, as Python values, READ_ROWS at a time."""
    for batch in batches:
        if field not in batch.schema.names:
            raise ConfigError(f"data.text_field: {where} has no column '{field}' (columns: "
                              f"{', '.join(batch.schema.names)}); set data.text_field to the text column")
        column = batch.column(field)
        for start in range(0, len(column), READ_ROWS):
            yield column.slice(start, READ_ROWS).to_pylist()


def record_slices(path: Path, field: str) -> Iterator[list[Any]]:
    """The text column of a .parquet or .arrow file, READ_ROWS values at a time."""
    pa = _pyarrow()
    if path.suffix == ".parquet":
        try:
            reader = pa.parquet.ParquetFile(path)
        except pa.ArrowException as e:
            raise ConfigError(f"data.source: {path} is not a Parquet file ({e})") from None
        if field not in reader.schema_arrow.names:
            raise ConfigError(f"data.text_field: {path} has no column '{field}' (columns: "
                              f"{', '.join(reader.schema_arrow.names)}); set data.text_field to the text column")
        yield from _column_slices(reader.iter_batches(batch_size=READ_ROWS, columns=[field]), field, str(path))
        return
    with pa.memory_map(str(path)) as source:
        try:  # datasets writes the stream format; `pyarrow.ipc.new_file` the file format
            reader = pa.ipc.open_stream(source)
            batches: Iterator[Any] = iter(reader)
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as e:
                raise ConfigError(f"data.source: {path} is not an Arrow IPC file ({e})") from None
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        yield from _column_slices(batches, field, str(path))


def rows_as_documents(slices: Iterator[list[Any]], prefix: str, where: str, field: str) -> Iterator[tuple[str, str]]:
    """(name, text) per row; a null text is an empty document (skipped), another type an error."""
    row = 0
    for values in slices:
        for value in values:
            row += 1
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"data.text_field: row {row} of {where} has a {type(value).__name__} "
                                  f"in column '{field}', not text; set data.text_field to a string column")
            yield f"{prefix}:{row}", value or ""


def parse_hf_source(source: str) -> tuple[str, str | None, str]:
    """'hf:NAME[:CONFIG][:SPLIT]' -> (name, config or None, split, default 'train')."""
    parts = source.removeprefix(HF_PREFIX).split(":")
    if not parts[0] or len(parts) > 3 or not all(parts):
        raise ConfigError(f"data.source: {source!r} is not hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT "
                          "(NAME: a datasets name or a local path)")
    name, config, split = parts[0], parts[1] if len(parts) == 3 else None, parts[-1] if len(parts) > 1 else "train"
    return name, config, split


def open_hf_dataset(source: str) -> tuple[Any, dict[str, Any]]:
    """The split `source` names as a (memory-mapped) datasets.Dataset, and its cache identity."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data.source: {source} needs the datasets package; {_INSTALL}") from None
    name, config, split = parse_hf_source(source)
    path = Path(name)
    try:
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
            dataset = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        else:
            dataset = datasets.load_dataset(name, config, split=split)
    except KeyError:
        raise ConfigError(f"data.source: {source} has no split '{split}' (name it: hf:NAME:SPLIT)") from None
    except (FileNotFoundError, ValueError, ConnectionError) as e:
        raise ConfigError(f"data.source: {source} cannot be loaded by datasets ({e})") from None
    identity = {"kind": "hf", "name": str(path.resolve()) if path.exists() else name, "config": config,
                "split": split, "fingerprint": dataset._fingerprint}
    return dataset, identity


def hf_slices(dataset: Any, field: str, source: str) -> Callable[[], Iterator[list[Any]]]:
    """Re-iterable reads of `dataset`'s text column, READ_ROWS rows at a time."""
    if field not in dataset.column_names:
        raise ConfigError(f"data.text_field: {source} has no column '{field}' (columns: "
                          f"{', '.join(dataset.column_names)}); set data.text_field to the text column")
    column = dataset.select_columns([field])
    return lambda: (batch[field] for batch in column.iter(batch_size=READ_ROWS))
