"""The hang watchdog's collective log merges torch's generic Flight Recorder with the collective
library's own (NCCL's on GPUs), so a hang report names NCCL's collectives too.

NCCL cannot run here: a stand-in for `CUDAAccelerator.dump_flight_recorder` returns what torch's
NCCL recorder dumps (the fields torch/distributed/flight_recorder reads; profiling_name
'nccl:<kind>', pg_status with last_started_collective), while the generic recorder is torch's
own, recording a real gloo group. (A real hang, end to end, is tests/distributed/test_elastic.py.)
"""

from __future__ import annotations

import copy
import json

import torch

from polytrain.backend.cuda import CUDAAccelerator
from polytrain.distributed.collective_log import FR_BUFFER_ENV, collective_log
from polytrain.distributed.hang_report import analyse, format_report
from tests.multirank import run_ranks


def _nccl_entry(seq: int, kind: str, done: bool, created_ns: int) -> dict:
    """One entry as torch's NCCL Flight Recorder dumps it (group '1', a tensor-parallel pair)."""
    return {"record_id": seq, "pg_id": 1, "process_group": ["1", "tp"], "collective_seq_id": seq, "p2p_seq_id": 0,
            "op_id": seq, "profiling_name": f"nccl:{kind}", "time_created_ns": created_ns,
            "input_sizes": [[8, 512]], "input_dtypes": ["BFloat16"], "output_sizes": [[16, 512]],
            "output_dtypes": ["BFloat16"], "state": "completed" if done else "started", "retired": done,
            "timeout_ms": 600000, "is_p2p": False, "duration_ms": 0.1 if done else None, "frames": []}


def _nccl_dump(entries: list[dict], enqueued: int, completed: int, generic: dict | None = None) -> str:
    """NCCL's dump; `generic`'s entries are copied in, as a recorder holding the same calls would."""
    status = {"1": {"last_enqueued_collective": str(enqueued), "last_started_collective": str(enqueued),
                    "last_completed_collective": str(completed)}}
    dup = copy.deepcopy(generic["entries"]) if generic else []
    return json.dumps({"version": "2.10", "nccl_version": "2.27.3", "pg_config": {}, "nccl_comm_state": {},
                       "pg_status": status, "entries": dup + entries})


def _logs(rank: int, world_size: int) -> tuple[dict, dict, list[dict]]:
    """On a real gloo group of one: an all_reduce in the generic recorder; then the logs of two ranks
    of an NCCL group '1', merged with it: rank 0 entered all_gather #2, rank 1 did not."""
    torch.distributed.all_reduce(torch.ones(4))
    generic = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
    now = generic["entries"][-1]["time_created_ns"]
    first = _nccl_entry(1, "reduce_scatter", True, now + 1_000)
    ahead = collective_log(lambda: _nccl_dump([first, _nccl_entry(2, "all_gather", False, now + 2_000)], 2, 1,
                                              generic))
    behind = collective_log(lambda: _nccl_dump([first], 1, 1))

    def broken() -> str:
        raise AttributeError("module has no attribute '_dump_nccl_trace_json'")

    garbled = collective_log(lambda: json.dumps({"entries": [{"collective_seq_id": 1}]}))
    return ahead, behind, [collective_log(broken), collective_log(lambda: None), garbled]


def test_the_backend_recorder_is_merged_with_the_generic_one_and_the_report_names_its_collective(monkeypatch):
    monkeypatch.setenv(FR_BUFFER_ENV, "100")  # before the group starts, as init_world does
    ahead, behind, without = run_ranks(1, _logs)[0]
    # The gloo all_reduce once, though both recorders hold it; NCCL's calls after it, oldest first.
    assert [(e["library"], e["kind"], e["group"], e["seq"], e["done"]) for e in ahead["entries"]] == [
        ("gloo", "all_reduce", "0", 1, True), ("nccl", "reduce_scatter", "1", 1, True),
        ("nccl", "all_gather", "1", 2, False)]
    assert ahead["status"] == {"0": {"enqueued": 1, "completed": 1}, "1": {"enqueued": 2, "completed": 1}}
    assert ahead["errors"] == [] and behind["status"]["1"] == {"enqueued": 1, "completed": 1}
    # Rank 1 never entered NCCL's all_gather: the report names it, and the group's ranks.
    dumps = []
    for rank, log in enumerate((ahead, behind)):
        dumps.append({"rank": rank, "world_size": 2, "host": "h", "pid": rank, "section": "step", "step": 5,
                      "waited_s": 60.0, "timeout_s": 60.0, "stacks": {}, **log,
                      "groups": {"0": [0, 1], "1": [0, 1]}})
    assert format_report(analyse(dumps, 2), dumps).splitlines()[0] == (
        "hang: rank(s) [1] did not enter collective #2 of the group of ranks [0, 1] (all_gather of [[8, 512]] "
        "BFloat16), which rank(s) [0] entered and wait in")
    # A backend recorder that is missing or has nothing leaves the generic one's collectives.
    broken, empty, garbled = without
    assert [e["kind"] for e in broken["entries"]] == [e["kind"] for e in empty["entries"]] == ["all_reduce"]
    assert broken["errors"] == ["backend Flight Recorder: AttributeError: module has no attribute "
                                "'_dump_nccl_trace_json'"] and empty["errors"] == []
    # One it cannot make sense of is reported, not raised: the watchdog must still dump and exit.
    assert garbled["entries"] == [] and garbled["errors"] == ["Flight Recorder dump not understood: "
                                                              "KeyError: 'process_group'"]


def test_cuda_has_no_flight_recorder_of_its_own_in_a_torch_built_without_nccl(monkeypatch):
    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_nccl_trace_json", raising=False)
    assert CUDAAccelerator().dump_flight_recorder() is None
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace_json",
                        lambda collectives, only_active: json.dumps({"asked": [collectives, only_active]}),
                        raising=False)
    assert json.loads(CUDAAccelerator().dump_flight_recorder()) == {"asked": [True, False]}
