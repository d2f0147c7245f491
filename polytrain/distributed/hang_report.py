"""Which rank and which collective a hang started at, from every rank's watchdog dump (watchdog.py).

Every rank of a process group issues the group's collectives in the same order, so the
n-th collective of a group (its sequence number) must be the same call on all of them:

- a rank whose last sequence number on a group is below the others' never entered the
  next collective, which the others are waiting in: it is the one to look at (its stack
  says where it is instead);
- two ranks whose n-th collective differs in kind, sizes or dtypes have desynchronised;
- all ranks inside the same collective with nothing missing: the transport itself hangs.

When several groups disagree, the first finding is the collective that has waited
longest (the oldest); the rest are its consequences. The same analysis as torch's
Flight Recorder analyser (torchfrtrace), on polytrain's dumps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    """What the dumps say; `kind` is missing, mismatch, in_collective, outside_collectives or no_dumps."""

    kind: str
    ranks: tuple[int, ...] = ()
    """The ranks to look at."""
    group: tuple[int, ...] = ()
    seq: int = 0
    collective: str = ""
    """e.g. 'all_reduce of [[1024]] Float'."""
    entered_by: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default=())


def _describe(entry: dict) -> str:
    return f"{entry['kind']} of {entry['sizes']} {','.join(entry['dtypes'])}"


def _by_group(dumps: list[dict]) -> dict[str, dict[int, list[dict]]]:
    """Group name -> rank -> that rank's collectives on it (point-to-point ones aside), by sequence number."""
    out: dict[str, dict[int, list[dict]]] = {}
    for d in dumps:
        for name in d.get("groups", {}):
            out.setdefault(name, {})[d["rank"]] = []
        for e in d.get("entries", []):
            if not e["p2p"]:
                out.setdefault(e["group"], {}).setdefault(d["rank"], []).append(e)
    for ranks in out.values():
        for entries in ranks.values():
            entries.sort(key=lambda e: e["seq"])
    return out


def _last_seq(dump: dict, group: str, entries: list[dict]) -> int:
    status = dump.get("status", {}).get(group)
    if status is not None:
        return status["enqueued"]
    return entries[-1]["seq"] if entries else 0


def analyse(dumps: list[dict], world_size: int) -> Finding:
    """The first disagreement among the ranks' dumps (see the module docstring)."""
    if not dumps:
        return Finding("no_dumps")
    by_rank = {d["rank"]: d for d in dumps}
    notes = tuple(f"rank {r} wrote no dump (its C-level stacks, if any, are in rank_{r}.stacks.txt)"
                  for r in range(world_size) if r not in by_rank)
    groups_ranks = {name: tuple(ranks) for d in dumps for name, ranks in d.get("groups", {}).items()}
    findings: list[tuple[float, Finding]] = []
    for name, per_rank in _by_group(dumps).items():
        members = tuple(groups_ranks.get(name, sorted(per_rank)))
        last = {r: _last_seq(by_rank[r], name, per_rank[r]) for r in per_rank}
        if len(set(last.values())) > 1:
            low = min(last.values())
            behind = tuple(sorted(r for r, s in last.items() if s == low))
            ahead = tuple(sorted(r for r, s in last.items() if s > low))
            missed = next((e for r in ahead for e in per_rank[r] if e["seq"] == low + 1), None)
            what = _describe(missed) if missed else f"collective #{low + 1}"
            age = missed["age_s"] if missed else 0.0
            findings.append((age, Finding("missing", behind, members, low + 1, what, ahead, notes)))
            continue
        seqs: dict[int, dict[int, dict]] = {}
        for r, entries in per_rank.items():
            for e in entries:
                seqs.setdefault(e["seq"], {})[r] = e
        for seq in sorted(seqs):
            calls = seqs[seq]
            shapes = {(e["kind"], str(e["sizes"]), str(e["dtypes"])) for e in calls.values()}
            if len(shapes) > 1:
                first = min(calls)
                odd = tuple(sorted(r for r, e in calls.items() if _describe(e) != _describe(calls[first])))
                text = "; ".join(f"rank {r}: {_describe(e)}" for r, e in sorted(calls.items()))
                age = max(e["age_s"] for e in calls.values())
                findings.append((age, Finding("mismatch", odd, members, seq, text, (first,), notes)))
                break
    if findings:
        return max(findings, key=lambda pair: pair[0])[1]
    pending = [(e["age_s"], d["rank"], e) for d in dumps for e in d.get("entries", []) if not e["done"]]
    if pending:
        _, _, entry = max(pending, key=lambda p: p[0])
        ranks = tuple(sorted({r for _, r, e in pending if e["seq"] == entry["seq"] and e["group"] == entry["group"]}))
        return Finding("in_collective", ranks, groups_ranks.get(entry["group"], ()), entry["seq"],
                       _describe(entry), ranks, notes)
    return Finding("outside_collectives", tuple(sorted(by_rank)), notes=notes)


def _where(dump: dict) -> str:
    """The innermost frames of the rank's main thread."""
    stack = dump.get("stacks", {}).get("MainThread", [])
    return " <- ".join(reversed(stack[-3:])) if stack else "(no Python stack)"


def format_report(finding: Finding, dumps: list[dict]) -> str:
    """The report: one line naming the rank and collective, then where each rank was."""
    group = f"the group of ranks {list(finding.group)}" if finding.group else "its group"
    if finding.kind == "missing":
        head = (f"hang: rank(s) {list(finding.ranks)} did not enter collective #{finding.seq} of {group} "
                f"({finding.collective}), which rank(s) {list(finding.entered_by)} entered and wait in")
    elif finding.kind == "mismatch":
        head = (f"hang: collective #{finding.seq} of {group} differs between ranks ({finding.collective}): "
                f"rank(s) {list(finding.ranks)} desynchronised")
    elif finding.kind == "in_collective":
        head = (f"hang: ranks {list(finding.ranks)} are all inside collective #{finding.seq} of {group} "
                f"({finding.collective}) and none is missing: the transport (network, a dead peer) stalls")
    elif finding.kind == "outside_collectives":
        head = "hang: no collective is pending on any rank; the ranks are stuck outside communication"
    else:
        head = "hang: no rank wrote a dump"
    lines = [head, *finding.notes]
    for d in sorted(dumps, key=lambda d: d["rank"]):
        lines.append(f"  rank {d['rank']} ({d['host']} pid {d['pid']}): {d['section']} {d['step']}, waited "
                     f"{d['waited_s']:.0f} s; at {_where(d)}")
    return "\n".join(lines)
