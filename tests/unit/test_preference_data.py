"""RLHF rows: DeepSpeed-Chat's local/jsonfile formats, bad rows as one line each, the 2,4,4 split, blending."""

import json

import pytest

from polytrain.data import sort_task
from polytrain.data.preference import (
    parse_split, phase_data, read_source, read_sources, split_indices,
)
from polytrain.errors import ConfigError


def _pairs(n, tag="p"):
    return [{"prompt": f" Human: {tag}{i} Assistant:", "chosen": f" yes{i}", "rejected": f" no{i}"}
            for i in range(n)]


def _write(path, rows, as_list=False):
    path.write_text(json.dumps(rows) if as_list else "".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reads_jsonl_json_lists_and_directories(tmp_path):
    a = read_source(_write(tmp_path / "a.jsonl", _pairs(3)))
    b = read_source(_write(tmp_path / "b.json", _pairs(2, "q"), as_list=True))
    assert a.kind == "pairs" and [r.chosen for r in a.rows] == [" yes0", " yes1", " yes2"]
    assert b.rows[1].prompt == " Human: q1 Assistant:"
    d = tmp_path / "local" / "data"  # DeepSpeed-Chat's local/jsonfile: data/train.json, data/eval.json
    d.mkdir(parents=True)
    _write(d / "train.json", _pairs(4), as_list=True)
    _write(d / "eval.json", _pairs(1, "e"), as_list=True)
    assert len(read_source(tmp_path / "local").rows) == 5
    demos = read_source(_write(tmp_path / "sft.jsonl", [{"prompt": "x", "response": " y"}]))
    assert demos.kind == "demos" and demos.rows[0].response == " y"


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "x", "chosen": " a"}], r"rows.jsonl line 1 has no non-empty string field 'rejected'"),
    ([{"prompt": "x", "chosen": " a", "rejected": " a"}], "line 1 has chosen identical to rejected"),
    ([{"prompt": "", "response": " a"}], "line 1 has no non-empty string field 'prompt'"),
    ([{"prompt": "x", "response": 3}], "field 'response'"),
    ([["not", "an", "object"]], "line 1 is not a JSON object"),
    ([{"prompt": "x", "response": " a"}, _pairs(1)[0]], "mixes preference rows and demonstration rows"),
    ([], "holds no rows"),
])
def test_bad_rows_are_one_line_each(tmp_path, rows, message):
    path = _write(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ConfigError, match=message) as e:
        read_source(path)
    assert "\n" not in str(e.value) and "rlhf.data" in str(e.value)


def test_bad_files_and_weights(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_source(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match="bad.jsonl line 1 is not valid JSON"):
        read_source(tmp_path / "bad.jsonl")
    (tmp_path / "obj.json").write_text('{"prompt": "x"}')
    with pytest.raises(ConfigError, match="must hold a JSON list"):
        read_source(tmp_path / "obj.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no .json or .jsonl files"):
        read_source(tmp_path / "empty")
    path = str(_write(tmp_path / "a.jsonl", _pairs(3)))
    with pytest.raises(ConfigError, match="rlhf.data_weights: .* must sum to a positive number"):
        read_sources([path, path], [0, 0])
    with pytest.raises(ConfigError, match="2 weights for 1 rlhf.data"):
        read_sources([path], [1, 2])


def test_split_is_deepspeed_chats_rule():
    assert parse_split("2,4,4") == (0.2, 0.4, 0.4)
    assert parse_split("1,1,0") == (0.5, 0.5, 0.0)
    for bad in ("2,4", "a,b,c", "0,0,0", "1,-1,2"):
        with pytest.raises(ConfigError, match="rlhf.data_split"):
            parse_split(bad)
    parts = split_indices(103, (0.2, 0.4, 0.4), seed=1, name="a")
    assert [len(p) for p in parts] == [21, 41, 41]  # boundaries round(0.2 n), round(0.6 n), n
    assert sorted(sum(parts, [])) == list(range(103))  # disjoint, everything used
    assert parts == split_indices(103, (0.2, 0.4, 0.4), seed=1, name="a")
    assert parts != split_indices(103, (0.2, 0.4, 0.4), seed=2, name="a")


def test_phases_see_disjoint_rows_and_blend_by_weight(tmp_path):
    a = read_source(_write(tmp_path / "a.jsonl", _pairs(50, "a")), weight=3)
    b = read_source(_write(tmp_path / "b.jsonl", _pairs(30, "b")), weight=1)
    demos = read_source(_write(tmp_path / "d.jsonl", [{"prompt": f"d{i}", "response": " r"} for i in range(8)]))
    split = parse_split("2,4,4")
    phases = {p: phase_data([a, b, demos], split, p, seed=3) for p in ("sft", "reward", "ppo")}
    prompts = {p: {d[i].prompt for i in range(len(d))} for p, d in phases.items()}
    assert not prompts["reward"] & prompts["ppo"] and not prompts["sft"] & prompts["reward"]
    assert not prompts["sft"] & prompts["ppo"]
    assert any(p.startswith("d") for p in prompts["sft"]) and not any(p.startswith("d") for p in prompts["ppo"])
    reward = phases["reward"]  # parts of 20 and 12 rows, 32 samples split 3:1
    assert reward.blend.counts == [24, 8]
    drawn = [reward[i].prompt for i in range(len(reward))]
    assert sum(p.startswith(" Human: a") for p in drawn) == 24
    kept = phase_data([a, b, demos], split, "reward", seed=3, hold_out=8)  # 8 of 32 rows: 5 of a's 20, 3 of b's 12
    assert len(kept.held_out) == 8 and sorted(len(r) for r in kept.sources) == [9, 15]
    assert not {r.prompt for r in kept.held_out} & {kept[i].prompt for i in range(len(kept))}
    assert not {r.prompt for r in kept.held_out} & (prompts["sft"] | prompts["ppo"])  # step 2's own rows
    no_sft_pairs = phase_data([a, demos], parse_split("0,5,5"), "sft", seed=3)  # a share of 0: demonstrations only
    assert {no_sft_pairs[i].prompt for i in range(len(no_sft_pairs))} == {f"d{i}" for i in range(8)}
    one = read_source(_write(tmp_path / "one.jsonl", _pairs(1)))  # parts of 0, 1 and 0 rows
    assert len(phase_data([one], split, "reward", seed=0)) == 1
    with pytest.raises(ConfigError, match=r"one.jsonl holds 1 row\(s\) .* leaves step 3 \(ppo\) none of them"):
        phase_data([one], split, "ppo", seed=0)
    with pytest.raises(ConfigError, match=r"step 3 \(ppo\) needs preference rows"):
        phase_data([demos], split, "ppo", seed=0)


def test_the_sorting_task_checks_answers_and_feeds_the_same_path(tmp_path):
    p = sort_task.prompt_for([3, 1, 2])
    assert p == " Human: sort 3 1 2 Assistant:"
    assert sort_task.task_score(p, " 1 2 3") == 1.0 and sort_task.task_score(p, "1 2 3 ") == 1.0
    assert sort_task.task_score(p, " 1 3 2") == 0.0 and sort_task.task_score(p, " 1 2") == 0.0
    with pytest.raises(ValueError, match="not a sorting prompt"):
        sort_task.task_score("hello", " 1")
    pairs = sort_task.preference_rows(200, seed=4)
    assert pairs == sort_task.preference_rows(200, seed=4)
    assert all(sort_task.task_score(r["prompt"], r["chosen"]) == 1.0 for r in pairs)
    assert all(sort_task.task_score(r["prompt"], r["rejected"]) == 0.0 for r in pairs)
    demos = sort_task.demonstration_rows(400, seed=4, noise=0.25)
    wrong = sum(sort_task.task_score(r["prompt"], r["response"]) == 0.0 for r in demos) / 400
    assert 0.18 < wrong < 0.32
    source = read_source(_write(tmp_path / "task.jsonl", pairs))  # rows pass the same validation
    assert len(phase_data([source], parse_split("2,4,4"), "ppo", seed=0)) == 80
