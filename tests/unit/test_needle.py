"""Needle-in-a-haystack data and evaluation: prompt construction, the passkey training windows,
the score grid (with stand-in generators whose right answers are known), and the CLI files."""

from __future__ import annotations

import json
import re

import pytest
import torch

from polytrain.cli import main
from polytrain.data.documents import document_ids
from polytrain.data.needle import Haystack, PasskeyDataset, needle_prompt, sample_rng
from polytrain.data.tokenizer import train_bpe
from polytrain.inference.needle import evaluate_needle, parse_lengths


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(["def main():\n    return 0\n" * 50, "The pass key is 12345. What is it?\n" * 20], 300)


@pytest.fixture(scope="module")
def haystack(tokenizer):
    return Haystack(tokenizer, 3000)


def test_document_ids_close_each_document_with_its_end_of_text():
    tokens = torch.tensor([[5, 6, 0, 7, 0, 0, 8]])  # eot = 0
    assert document_ids(tokens, 0).tolist() == [[0, 0, 0, 1, 1, 2, 3]]


@pytest.mark.parametrize("depth", [0, 37.5, 100])
def test_prompt_has_the_exact_length_and_the_needle_at_its_depth(tokenizer, haystack, depth):
    p = needle_prompt(tokenizer, haystack, 400, depth, sample_rng(0, depth))
    assert len(p.prompt) == 400 and re.fullmatch(r"\d{5}", p.answer)
    text = tokenizer.decode(p.prompt)
    assert text.endswith("What is the pass key? The pass key is")
    hay_chars = len(text) - len(" What is the pass key? The pass key is")
    where = text.index(f"The pass key is {p.answer}")
    assert abs(where / hay_chars - depth / 100) < 0.15  # tokens vs characters: roughly the same place


def test_multi_needle_prompt_asks_for_one_of_several_keys(tokenizer, haystack):
    p = needle_prompt(tokenizer, haystack, 500, 10, sample_rng(0, "multi"), needles=3)
    text = tokenizer.decode(p.prompt)
    stated = re.findall(r"The pass key of (\w+) is (\d{5})\. Remember", text)
    asked = re.search(r"What is the pass key of (\w+)\?", text).group(1)
    assert len(stated) == 3 and dict(stated)[asked] == p.answer


def test_passkey_windows_score_only_the_answer(tokenizer):
    ds = PasskeyDataset(tokenizer, 128, seed=1, n_samples=10)
    inputs, targets = ds.get_batch([3, 4])
    assert inputs.shape == targets.shape == (2, 128)
    assert torch.equal(inputs[:, 1:], targets[:, :-1].where(targets[:, :-1] >= 0, inputs[:, 1:]))
    for row in range(2):
        scored = targets[row][targets[row] >= 0]
        assert re.fullmatch(r" \d{5}\.", tokenizer.decode(scored))
        assert torch.equal(targets[row, -len(scored):], scored)  # the answer ends the window
    again, _ = ds.get_batch([4])
    assert torch.equal(again[0], inputs[1])  # a sample depends on its index only


def _oracle(tokenizer, fail_beyond=None):
    """Reads the key out of the prompt (fails where the needle sits past `fail_beyond` of the text
    before the question)."""
    def generate_fn(model, prompts, max_new_tokens, temperature):
        outs = []
        for prompt in prompts:
            text = tokenizer.decode(prompt)
            found = re.search(r"The pass key is (\d{5})", text)
            deep = fail_beyond is not None and found.start() > fail_beyond * text.index(" What is")
            outs.append(tokenizer.encode(" 00000." if deep else f" {found.group(1)}."))
        return outs
    return generate_fn


def test_score_grid_is_lengths_by_depths(tokenizer):
    model = torch.nn.Module()
    model.cfg = type("Cfg", (), {"max_seq_len": 1024})()
    lengths, depths = [256, 512], [0, 50, 100]
    perfect = evaluate_needle(model, tokenizer, lengths, depths, repeats=2, generate_fn=_oracle(tokenizer))
    assert perfect["scores"] == [[100.0] * 3] * 2 and perfect["overall"] == 100
    shallow = evaluate_needle(model, tokenizer, lengths, depths, generate_fn=_oracle(tokenizer, 0.7))
    assert shallow["scores"] == [[100.0, 100.0, 0.0]] * 2  # [per depth] per length
    assert parse_lengths("1024,4k") == [1024, 4096]


def _tiny_run(tmp_path, tokenizer):
    """A run directory of a randomly initialised Llama (through an HF directory written by hand)."""
    from safetensors.torch import save_file

    from polytrain.config import ModelConfig
    from polytrain.convert import import_hf
    from polytrain.models.common.init import init_plain
    from polytrain.models.llama import hf
    from polytrain.models.llama.model import Llama

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48,
                      vocab_size=tokenizer.vocab_size, max_seq_len=512)
    model = Llama(cfg)
    init_plain(model, 0)
    source = tmp_path / "hf"
    source.mkdir()
    config = {**hf.config_to_hf(cfg), "max_position_embeddings": cfg.max_seq_len}
    (source / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in hf.state_to_hf(model.state_dict(), cfg).items()},
              source / "model.safetensors")
    tokenizer.save(source / "tokenizer.json")
    return import_hf(source, tmp_path / "run")


def test_cli_writes_needle_json_and_png(tmp_path, tokenizer, capsys):
    run = _tiny_run(tmp_path, tokenizer)
    assert main(["eval", "needle", str(run), "--lengths", "128,256", "--depths", "0,100",
                 "--repeats", "1", "--out", str(tmp_path / "eval")]) == 0
    result = json.loads((tmp_path / "eval" / "needle.json").read_text())
    assert result["lengths"] == [128, 256] and result["depths"] == [0, 100]
    assert len(result["scores"]) == 2 and all(len(r) == 2 and all(0 <= s <= 100 for s in r)
                                              for r in result["scores"])
    assert (tmp_path / "eval" / "needle.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "needle", str(run), "--lengths", "1k"]) == 2  # past max_seq_len: one error line
    assert "needs model.max_seq_len >= " in capsys.readouterr().err


def test_generate_over_two_context_parallel_workers_equals_one_process(tmp_path, tokenizer, capfd):
    """`polytrain generate --parallel.cp 2`: the run loaded on 2 workers, the KV cache split over them."""
    run = _tiny_run(tmp_path, tokenizer)
    prompt = ["generate", str(run), "--prompt", "def main():\n    return", "--max-new-tokens", "12",
              "--temperature", "0"]
    assert main(prompt) == 0
    single = capfd.readouterr().out
    assert main(prompt + ["--parallel.cp", "2"]) == 0
    assert capfd.readouterr().out == single != "def main():\n    return\n"  # the same new tokens


@pytest.mark.parametrize("score", ["all", "answer"])
def test_trainer_scores_the_passkey_targets_data_passkey_score_names(small_corpus, tmp_path, score):
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer
    from tests.conftest import tiny_overrides

    cfg = load_config(None, tiny_overrides(small_corpus, tmp_path, data__task="passkey",
                                           data__passkey_score=score, data__seq_len=96))
    trainer = Trainer(cfg)
    trainer.close()  # only its datasets are read: no watchdog or metrics file left open
    for data in (trainer.train_data, trainer.val_data):
        inputs, targets = data.get_batch([0, 1])
        scored = (targets >= 0).sum(dim=1)
        if score == "all":  # every next token, the haystack's too
            assert scored.tolist() == [96, 96] and torch.equal(inputs[:, 1:], targets[:, :-1])
        else:  # the key's tokens (" 12345.") only, at the window's end
            assert (scored < 10).all() and re.fullmatch(r" \d{5}\.", trainer.tokenizer.decode(targets[0][-int(scored[0]):]))
