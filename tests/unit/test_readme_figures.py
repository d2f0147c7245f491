"""Every figure README.md's "Measured" section quotes is in benchmarks/RESULTS.md, in the section
the line names, with a date, the commit it was recorded in and the command of the script the
line cites (issue 14: figures in the README must be true today, and traceable)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION_REF = re.compile(r'RESULTS: "([^"]+)"')
SCRIPT = re.compile(r"benchmarks/(\w+)\.py")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _measured_bullets(readme: str) -> list[str]:
    body = readme.split("\n## Measured\n", 1)[1].split("\n## ", 1)[0]
    return [" ".join(b.split()) for b in re.split(r"\n- ", body)[1:]]


def _sections(results: str) -> dict[str, str]:
    parts = re.split(r"^##+ (.+)$", results, flags=re.M)
    return {title.strip(): text for title, text in zip(parts[1::2], parts[2::2])}


def check(readme: str, results: str) -> list[str]:
    """What is wrong, one line per problem (empty: every quoted figure is traceable)."""
    sections, problems = _sections(results), []
    for bullet in _measured_bullets(readme):
        refs, scripts = SECTION_REF.findall(bullet), set(SCRIPT.findall(bullet))
        if not refs or not scripts:
            problems.append(f"names no RESULTS section or no benchmark script: {bullet[:70]}")
            continue
        text = " ".join(sections.get(r, "") for r in refs)
        missing = [r for r in refs if r not in sections]
        if missing:
            problems.append(f"no RESULTS section {missing}")
            continue
        if not re.search(r"\b20\d\d-\d\d-\d\d\b", text):
            problems.append(f"{refs}: no date")
        if not re.search(r"(Recorded in commit|Measured on) `[0-9a-f]{7,40}`", text):
            problems.append(f"{refs}: no commit")
        for script in scripts:
            if f"benchmarks/{script}.py" not in text:
                problems.append(f"{refs}: no command running benchmarks/{script}.py")
        for figure in re.findall(r"\*\*(.+?)\*\*", bullet):
            for number in NUMBER.findall(figure):
                if number not in text:
                    problems.append(f"{refs}: {figure!r} ({number}) is not in the section")
    return problems


def test_every_quoted_figure_is_in_results_with_date_commit_and_command():
    readme = (ROOT / "README.md").read_text()
    assert _measured_bullets(readme), "README.md has no Measured bullets"
    assert check(readme, (ROOT / "benchmarks/RESULTS.md").read_text()) == []


def test_the_check_catches_a_figure_results_does_not_have():
    readme = ('\n## Measured\n\nIntro.\n\n- It runs at **1.23x** the peer (`benchmarks/gen.py`; '
              'RESULTS: "Generation").\n\n## Layout\n')
    good = "## Generation\n\nRecorded in commit `abc1234`.\n\n`python benchmarks/gen.py`\n\n2026-12-01: 1.23x\n"
    assert check(readme, good) == []
    assert check(readme, good.replace("1.23x", "1.10x")) == ["['Generation']: '1.23x' (1.23) is not in the section"]
    assert check(readme, good.replace("Recorded in commit `abc1234`.", "")) == ["['Generation']: no commit"]
    assert check(readme, good.replace("2026-12-01", "today")) == ["['Generation']: no date"]
    assert check(readme, good.replace("## Generation", "## Other")) == ["no RESULTS section ['Generation']"]
