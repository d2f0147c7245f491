"""HF -> polytrain -> HF is bit-identical; the export loads in transformers without custom code.

Also: the converted run directory works with `polytrain generate`, `polytrain.load` and
the trainer (fine-tuning starts from the imported weights), and bad input fails with
one line naming the problem.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import polytrain
from polytrain.cli import main
from polytrain.config import load_config
from polytrain.convert import export_hf, import_hf
from polytrain.data.tokenizer import train_bpe
from tests.conftest import tiny_overrides
from tests.models import hf_models

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
CASES = {
    "gpt2": lambda: hf_models.gpt2(),
    "gpt2-untied": lambda: hf_models.gpt2(tie_word_embeddings=False, vocab_size=97),
    "llama-gqa": lambda: hf_models.llama(),
    "llama-tied-llama3": lambda: hf_models.llama(tie_word_embeddings=True, rope_scaling=LLAMA3),
    "llama-dynamic": lambda: hf_models.llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "bert": lambda: hf_models.bert(vocab_size=97),
    "t5-v1.0": lambda: hf_models.t5(),
    "t5-v1.1": lambda: hf_models.t5(untied=True, feed_forward_proj="gated-gelu", num_decoder_layers=3),
}
AUTO = {"gpt2": transformers.AutoModelForCausalLM, "llama": transformers.AutoModelForCausalLM,
        "bert": transformers.AutoModelForMaskedLM, "t5": transformers.AutoModelForSeq2SeqLM}


def assert_same_files(a, b):
    sa, sb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def logits(model, vocab):
    x = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(input_ids=x, decoder_input_ids=x[:, :5]).logits
        return model(input_ids=x).logits


@pytest.mark.parametrize("case", CASES)
def test_round_trip_bit_identical_and_loadable_by_transformers(case, tmp_path):
    hf = CASES[case]()
    source = hf_models.save(hf, tmp_path / "hf")
    run = import_hf(source, tmp_path / "run")
    out = export_hf(run, tmp_path / "back")
    assert_same_files(source, out)
    again = AUTO[case.split("-")[0]].from_pretrained(out)  # no trust_remote_code: built-in classes
    assert type(again) is type(hf)
    assert torch.equal(logits(again.eval(), hf.config.vocab_size), logits(hf, hf.config.vocab_size))


def test_internlm2_round_trip_keeps_the_remote_code_layout(tmp_path):
    """transformers has no InternLM2 class: check the file is byte-for-byte the remote code's
    layout (names, packed wqkv, shapes) and the config carries what its code reads."""
    reference = hf_models.llama(num_attention_heads=6, hidden_size=36, num_key_value_heads=2,
                                rope_scaling={"rope_type": "dynamic", "factor": 2.0}, rope_theta=1e6)
    source = hf_models.internlm2_dir(reference, tmp_path / "hf")
    (source / "modeling_internlm2.py").write_text("# the model repository's remote code\n")
    out = export_hf(import_hf(source, tmp_path / "run"), tmp_path / "back")
    assert_same_files(source, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["InternLM2ForCausalLM"] and config["model_type"] == "internlm2"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_internlm2.InternLM2ForCausalLM"
    assert config["rope_scaling"] == {"type": "dynamic", "factor": 2.0} and config["bias"] is False
    assert config["max_position_embeddings"] == reference.config.max_position_embeddings
    assert (out / "modeling_internlm2.py").read_text() == "# the model repository's remote code\n"


def test_bf16_checkpoint_round_trips_in_bf16(tmp_path):
    hf = hf_models.llama().to(torch.bfloat16)
    source = hf_models.save(hf, tmp_path / "hf")
    run = import_hf(source, tmp_path / "run")
    assert_same_files(source, export_hf(run, tmp_path / "back"))
    fp32 = export_hf(run, tmp_path / "fp32", dtype="fp32")
    assert all(t.dtype == torch.float32 for t in load_file(fp32 / "model.safetensors").values())
    assert json.loads((fp32 / "config.json").read_text())["dtype"] == "float32"


@pytest.fixture
def gpt2_with_tokenizer(tmp_path):
    """An HF GPT-2 directory with a tokenizer.json (a small BPE trained here)."""
    tokenizer = train_bpe(["def main():\n    return 0\n" * 50, "import os\nprint(os.sep)\n" * 50], 300)
    hf = hf_models.gpt2(vocab_size=tokenizer.vocab_size + 3)  # a padded vocabulary, as real models have
    source = hf_models.save(hf, tmp_path / "hf")
    tokenizer.save(source / "tokenizer.json")
    return hf, source


def test_cli_convert_then_generate_and_load(gpt2_with_tokenizer, tmp_path, capsys):
    hf, source = gpt2_with_tokenizer
    run = tmp_path / "run"
    assert main(["convert", str(source), str(run)]) == 0
    assert (run / "config.toml").is_file() and (run / "checkpoints" / "step_0" / "trainer.json").is_file()
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    for path in (run, run / "checkpoints" / "step_0", source):
        model, tokenizer = polytrain.load(path)
        assert tokenizer.vocab_size == hf.config.vocab_size - 3
        x = torch.tensor([tokenizer.encode("def main():")])
        with torch.no_grad():
            assert (model(x) - hf(input_ids=x).logits).abs().max() < 1e-4
    assert main(["convert", "--to", "hf", str(run), str(tmp_path / "back")]) == 0
    assert_same_files(source, tmp_path / "back")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "back").encode("def main():") == \
        tokenizer.encode("def main():")


def test_training_starts_from_converted_weights(gpt2_with_tokenizer, small_corpus, tmp_path):
    from polytrain.train.trainer import Trainer

    _, source = gpt2_with_tokenizer
    run = import_hf(source, tmp_path / "run")
    converted = load_config(run / "config.toml")
    overrides = tiny_overrides(small_corpus, tmp_path / "finetune", **{
        "checkpoint.resume": str(run / "checkpoints" / "step_0"), "run.steps": 2})
    pairs = zip(overrides[::2], overrides[1::2])  # keep the converted model's shape: no --model.*
    overrides = [a for key, value in pairs if not key.startswith("--model.") for a in (key, value)]
    overrides += ["--data.seq_len", "32"]
    trainer = Trainer(load_config(run / "config.toml", overrides))
    assert trainer.step == 0 and trainer.cfg.model == converted.model
    imported, _ = polytrain.load(run)
    for name, value in imported.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], value), name
    summary = trainer.train()
    assert summary["step"] == 2 and (tmp_path / "finetune" / "checkpoints" / "step_2").is_dir()
    # The fine-tuned run exports with the imported model's kept files (its config.json's ids).
    out = export_hf(tmp_path / "finetune", tmp_path / "exported")
    assert json.loads((out / "config.json").read_text())["n_positions"] == 64
    assert (out / "generation_config.json").is_file()


def test_export_of_a_polytrain_trained_model(small_corpus, tmp_path):
    """A gpt2 trained by polytrain exports to a directory transformers loads, with the same logits."""
    from polytrain.train.trainer import Trainer

    cfg = load_config(None, tiny_overrides(small_corpus, tmp_path / "run", **{
        "model.arch": "gpt2", "model.n_kv_heads": 4, "run.steps": 2}))
    Trainer(cfg).train()
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    model, tokenizer = polytrain.load(tmp_path / "run")
    x = torch.tensor([tokenizer.encode("import json\n")])
    with torch.no_grad():
        assert (model(x) - hf(input_ids=x).logits).abs().max() < 1e-4
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer.encode("import json\n") == tokenizer.encode("import json\n")


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_convert_errors_name_the_problem(tmp_path, capsys):
    source = hf_models.save(hf_models.gpt2(), tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    weights = load_file(source / "model.safetensors")
    capsys.readouterr()

    assert "does-not-exist is not a directory" in _error(["convert", str(tmp_path / "does-not-exist"),
                                                          str(tmp_path / "o1")], capsys)
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _error(["convert", str(tmp_path / "empty"), str(tmp_path / "o2")], capsys)

    def variant(name, config_changes=None, tensors=None):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
        if tensors is not None:
            save_file(tensors, str(path / "model.safetensors"))
        return str(path)

    err = _error(["convert", variant("mistral", {"model_type": "mistral"}, weights), str(tmp_path / "o3")], capsys)
    assert "unknown Hugging Face model_type 'mistral'" in err and "converts: llama, internlm2, gpt2, bert, t5" in err
    assert "has no weights" in _error(["convert", variant("noweights"), str(tmp_path / "o4")], capsys)
    err = _error(["convert", variant("vocab", {"vocab_size": 100}, weights), str(tmp_path / "o5")], capsys)
    assert "tok_embeddings.weight (from transformer.wte.weight) has shape (101, 32); the config gives (100, 32)" in err
    missing = {k: v for k, v in weights.items() if k != "transformer.h.1.ln_2.bias"}
    err = _error(["convert", variant("missing", None, missing), str(tmp_path / "o6")], capsys)
    assert "has no tensor 'transformer.h.1.ln_2.bias'" in err
    extra = {**weights, "transformer.h.9.attn.c_attn.weight": torch.zeros(2)}
    err = _error(["convert", variant("extra", None, extra), str(tmp_path / "o7")], capsys)
    assert "has no place for: transformer.h.9.attn.c_attn.weight" in err
    err = _error(["convert", variant("inverse", {"scale_attn_by_inverse_layer_idx": True}, weights),
                  str(tmp_path / "o8")], capsys)
    assert "scale_attn_by_inverse_layer_idx = true is not supported" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "exists and is not an empty directory" in _error(["convert", str(source), str(tmp_path / "full")], capsys)
    assert "neither a polytrain run directory nor a checkpoint" in _error(
        ["convert", "--to", "hf", str(source), str(tmp_path / "o9")], capsys)
