"""Hang detection: the report names the rank and collective that disagree; a rank that stops entering
a collective makes every rank's watchdog dump its stacks and collectives and end the attempt."""

from __future__ import annotations

import json
import os

import pytest

from polytrain.distributed.hang_report import analyse, format_report
from polytrain.distributed.watchdog import EXIT_HANG
from polytrain.train.faults import HANG_ENV
from tests.conftest import tiny_overrides
from tests.multirank import run_ranks


def _entry(seq, kind="all_reduce", sizes=((1024,),), done=True, group="0", age=1.0):
    return {"seq": seq, "p2p_seq": 0, "p2p": False, "group": group, "kind": kind, "sizes": [list(s) for s in sizes],
            "dtypes": ["Float"], "done": done, "age_s": age}


def _dump(rank, entries, groups=None, step=3):
    groups = groups or {"0": [0, 1, 2]}
    last = {g: max([e["seq"] for e in entries if e["group"] == g], default=0) for g in groups}
    return {"rank": rank, "world_size": 3, "host": "h", "pid": 100 + rank, "section": "step", "step": step,
            "waited_s": 30.0, "timeout_s": 30.0, "groups": groups, "entries": entries,
            "status": {g: {"enqueued": s, "completed": s} for g, s in last.items()},
            "stacks": {"MainThread": [f"trainer.py:{10 + rank} in train_step: x"]}}


def test_analysis_names_the_rank_behind_and_the_collective():
    ok = [_entry(1), _entry(2), _entry(3, sizes=((4096,),), done=False, age=31.0)]
    dumps = [_dump(0, ok), _dump(1, ok[:2]), _dump(2, ok)]
    finding = analyse(dumps, 3)
    assert (finding.kind, finding.ranks, finding.seq, finding.entered_by) == ("missing", (1,), 3, (0, 2))
    text = format_report(finding, dumps)
    assert text.splitlines()[0] == ("hang: rank(s) [1] did not enter collective #3 of the group of ranks "
                                    "[0, 1, 2] (all_reduce of [[4096]] Float), which rank(s) [0, 2] entered "
                                    "and wait in")
    assert "rank 1 (h pid 101): step 3, waited 30 s; at trainer.py:11 in train_step: x" in text


def test_analysis_finds_desync_transport_stalls_and_missing_dumps():
    a = [_entry(1), _entry(2, kind="all_gather", done=False)]
    b = [_entry(1), _entry(2, kind="broadcast", done=False)]
    mismatch = analyse([_dump(0, a), _dump(1, a), _dump(2, b)], 3)
    assert (mismatch.kind, mismatch.ranks, mismatch.seq) == ("mismatch", (2,), 2)
    stuck = analyse([_dump(0, a), _dump(1, a)], 3)
    assert (stuck.kind, stuck.ranks, stuck.seq) == ("in_collective", (0, 1), 2)
    assert stuck.notes == ("rank 2 wrote no dump (its C-level stacks, if any, are in rank_2.stacks.txt)",)


def _hang(rank, world_size, overrides):
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    os.environ[HANG_ENV] = "1:3"  # rank 1 stops before step 3's collectives
    Trainer(load_config(None, overrides)).train()


@pytest.mark.slow
def test_a_rank_that_stops_entering_collectives_is_named(small_corpus, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(AssertionError, match=f"died with exit code {EXIT_HANG}"):
        run_ranks(2, _hang, tiny_overrides(small_corpus, run, run__steps=6, run__hang_timeout_s=4), timeout=300)
    hang = run / "hang" / "attempt_0"
    report = (hang / "report.txt").read_text()
    assert report.startswith("hang: rank(s) [1] did not enter collective #"), report
    assert "of the group of ranks [0, 1] (all_reduce" in report and "which rank(s) [0] entered" in report
    dumps = {r: json.loads((hang / f"rank_{r}.json").read_text()) for r in (0, 1)}
    assert dumps[0]["step"] == dumps[1]["step"] == 3
    assert any("time.sleep" in frame or "sleep(1)" in frame for frame in dumps[1]["stacks"]["MainThread"])
    assert [e for e in dumps[0]["entries"] if not e["done"]], "rank 0 waits in an unfinished collective"
