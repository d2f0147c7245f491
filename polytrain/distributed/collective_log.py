"""A rank's last collectives, from torch's Flight Recorders, for the hang watchdog (watchdog.py).

torch keeps two recorders: the generic one (`_dump_fr_trace_json`), where gloo and other
backends record, and NCCL's own, where ProcessGroupNCCL records (`_dump_nccl_trace_json`,
only in torch builds with NCCL). The accelerator says whether its collective library has a
recorder of its own (`Accelerator.dump_flight_recorder`); the log is both recorders merged,
an entry present in both counted once, so a job whose groups mix libraries (NCCL for the
tensors, gloo for objects) shows every group's collectives.

Both dumps are torch's JSON: `entries` (one per collective: process_group [name, desc],
collective_seq_id, p2p_seq_id, op_id, profiling_name '<library>:<kind>', input_sizes,
input_dtypes, time_created_ns, state, retired) and `pg_status` (per group name, the last
enqueued and completed sequence numbers, as text).

The recorders are ring buffers (TORCH_FR_BUFFER_SIZE, set by init_world before the process
group starts): a few hundred bytes per collective, recorded in C++, read only when a
watchdog fires.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

RECENT = 64
"""Collectives per rank kept in a dump (the newest)."""
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
FR_BUFFER_DEFAULT = "2000"

BackendRecorder = Callable[[], str | None]
"""Returns the collective library's own Flight Recorder dump (JSON text), or None if it has none."""


def enable_collective_log() -> None:
    """Turn on torch's Flight Recorders for the process groups created after this (unless set already)."""
    os.environ.setdefault(FR_BUFFER_ENV, FR_BUFFER_DEFAULT)


def _generic_recorder() -> str:
    return torch._C._distributed_c10d._dump_fr_trace_json(True, False)  # every collective, not only active ones


def _identity(entry: dict) -> tuple:
    """What makes a recorded collective one call: its group and its numbers within the group."""
    return (entry["process_group"][0], entry["collective_seq_id"], entry["p2p_seq_id"], entry.get("op_id"),
            entry["profiling_name"])


def merge_traces(traces: list[dict]) -> dict:
    """One trace from several recorders' dumps: entries oldest first, each call once; a group's status
    the furthest any recorder saw (a group is one library's, so normally only one has it)."""
    entries: dict[tuple, dict] = {}
    status: dict[str, dict[str, int]] = {}
    for trace in traces:
        for entry in trace.get("entries", []):
            entries.setdefault(_identity(entry), entry)
        for name, s in trace.get("pg_status", {}).items():
            seen = status.setdefault(name, {"enqueued": -1, "completed": -1})
            seen["enqueued"] = max(seen["enqueued"], int(s["last_enqueued_collective"]))
            seen["completed"] = max(seen["completed"], int(s["last_completed_collective"]))
    ordered = sorted(entries.values(), key=lambda e: e["time_created_ns"])
    return {"entries": ordered, "status": status}


def _log_entry(entry: dict, now_ns: int) -> dict:
    """polytrain's record of one collective (what hang_report.py reads)."""
    library, _, kind = entry["profiling_name"].rpartition(":")
    # gloo leaves `state` at 'scheduled' and marks a finished call retired; NCCL sets 'completed'.
    done = bool(entry["retired"]) or entry.get("state") == "completed"
    return {"seq": entry["collective_seq_id"], "p2p_seq": entry["p2p_seq_id"], "p2p": entry["is_p2p"],
            "group": entry["process_group"][0], "kind": kind, "library": library,
            "sizes": entry["input_sizes"], "dtypes": entry["input_dtypes"], "done": done,
            "age_s": round((now_ns - entry["time_created_ns"]) / 1e9, 3)}


def _process_groups() -> dict[str, list[int]]:
    """Each process group's name and global ranks."""
    groups: dict[str, list[int]] = {}
    if dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        for group, name in c10d._world.pg_names.items():
            with contextlib.suppress(Exception):  # a group this rank is not in has no ranks to give
                groups[name] = dist.get_process_group_ranks(group)
    return groups


def collective_log(backend_recorder: BackendRecorder | None = None) -> dict:
    """This rank's recorded collectives (the newest RECENT), each group's status and ranks, and what
    could not be read (`errors`; a hang report then names fewer collectives). Never raises: it runs
    in the watchdog, which must still dump the stacks and end the attempt."""
    traces, errors = [], []
    for name, read in (("generic", _generic_recorder), ("backend", backend_recorder)):
        if read is None:
            continue
        try:
            text = read()
            if text is not None:
                traces.append(json.loads(text))
        except Exception as e:  # noqa: BLE001 (absent from this build, not started, another signature)
            errors.append(f"{name} Flight Recorder: {type(e).__name__}: {e}")
    try:
        merged = merge_traces(traces)
        now = time.time_ns()
        entries, status = [_log_entry(e, now) for e in merged["entries"][-RECENT:]], merged["status"]
    except (KeyError, TypeError, ValueError, IndexError) as e:  # a dump of another torch's format
        entries, status = [], {}
        errors.append(f"Flight Recorder dump not understood: {type(e).__name__}: {e}")
    return {"groups": _process_groups(), "entries": entries, "status": status, "errors": errors}
