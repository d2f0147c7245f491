"""Hang detection's analysis: the report names the rank and collective that disagree. (A real hang,
dumped by every rank's watchdog and restarted, is tests/distributed/test_elastic.py's first test.)"""

from __future__ import annotations

from polytrain.distributed.hang_report import analyse, format_report


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
