"""Read back what each metrics sink stored, through the sink's own file format or client, for
tests/unit/test_loggers.py and tests/e2e/test_loggers.py: {(step, key): value}, the last value
logged for each pair, and the config the sink recorded."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

# W&B's .wandb transaction log: a 7-byte file header (":W&B", magic, version), then LevelDB
# log records in 32 KiB blocks: crc32 (4 bytes), length (2, little-endian), type (1), payload.
# Types 1 = a whole record, 2/3/4 = first/middle/last piece of one spanning blocks.
WANDB_BLOCK = 32 * 1024
WANDB_HEADER = 7


def wandb_records(run_dir: Path) -> list[Any]:
    """The protobuf records of the one offline W&B run under run_dir/wandb."""
    from wandb.proto import wandb_internal_pb2

    (log,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    data = log.read_bytes()
    assert data[:4] == b":W&B", f"{log} is not a W&B transaction log"
    records, pieces, pos = [], b"", WANDB_HEADER
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # the block's tail is padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break  # zero fill past the last record
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def _key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)  # W&B writes either


def wandb_history(run_dir: Path) -> dict[tuple[int, str], float]:
    out = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            step = row.pop("_step")
            out |= {(step, key): value for key, value in row.items() if not key.startswith("_")}
    return out


def wandb_run(run_dir: Path) -> tuple[Any, dict[str, Any]]:
    """(the run record: display_name, project, entity), the config it holds with later updates applied."""
    run, config = None, {}
    for record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config |= {_key(item): json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "config":
            config |= {_key(item): json.loads(item.value_json) for item in record.config.update}
    return run, {key: value["value"] if isinstance(value, dict) and "value" in value else value
                 for key, value in config.items() if not key.startswith("_")}


def mlflow_run(tracking_uri: str, experiment: str) -> tuple[Any, dict[tuple[int, str], float]]:
    """(the one MLflow run of `experiment`, its metrics {(step, key): value})."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    metrics = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            metrics[(m.step, key)] = m.value
    return run, metrics


def tensorboard_scalars(log_dir: Path) -> dict[tuple[int, str], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}


def jsonl_scalars(rows: list[dict[str, Any]]) -> dict[tuple[int, str], float]:
    """What a sink should hold: every number of every row but the step, by (step, key); last wins."""
    return {(row["step"], key): value for row in rows for key, value in row.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
