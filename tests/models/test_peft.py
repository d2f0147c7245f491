"""LoRA adapters <-> Hugging Face PEFT, exactly: import, export, load in PEFT, merge, train on.

For llama and gpt2 (whose q, k, v are one packed Conv1D): a PEFT adapter with random A and
B imports into polytrain with PEFT's logits; its `--to peft` export loads in PEFT on the
original HF model with the same logits (llama: the very tensors; gpt2: c_attn comes back as
a stacked rank-3r adapter, which imports again into the first import's tensors); the merged
`--to hf` export gives them in plain transformers. Then a polytrain LoRA fine-tune resumes
from the imported adapters on their base and saves adapters only.
"""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

import polytrain
from polytrain.checkpoint.consolidate import read_model_tensors
from polytrain.checkpoint.trainer_state import read_state
from polytrain.cli import main
from polytrain.config import load_config
from polytrain.convert import import_hf
from polytrain.convert.peft import import_peft
from polytrain.data.tokenizer import train_bpe
from polytrain.errors import CheckpointError
from tests.conftest import tiny_overrides
from tests.models import hf_models

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids) if isinstance(model, (transformers.PreTrainedModel, peft.PeftModel)) else model(ids)
    return out.logits if hasattr(out, "logits") else out


def hf_with_tokenizer(case: str, path):
    """A tiny HF model (`case`) saved at `path` with a small BPE tokenizer.json of its vocabulary."""
    tokenizer = train_bpe(["def main():\n    return 0\n" * 50, "import os\nprint(os.sep)\n" * 50], 300)
    hf = getattr(hf_models, case)(vocab_size=tokenizer.vocab_size)
    tokenizer.save(hf_models.save(hf, path) / "tokenizer.json")
    return hf


@pytest.fixture
def gpt2_with_tokenizer(tmp_path):
    return hf_with_tokenizer("gpt2", tmp_path / "hf")


@pytest.mark.parametrize("case", list(TARGETS))
def test_peft_round_trip_is_exact(case, tmp_path):
    hf = hf_with_tokenizer(case, tmp_path / "hf")
    hf_dir = tmp_path / "hf"
    base = import_hf(hf_dir, tmp_path / "base")
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[case], init_lora_weights=False)
    adapted = peft.get_peft_model(copy.deepcopy(hf), lora).eval()
    adapted.save_pretrained(tmp_path / "peft")
    ids = torch.randint(0, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    want = _logits(adapted, ids)

    assert main(["convert", str(tmp_path / "peft"), str(tmp_path / "run"), "--base", str(base)]) == 0
    model, _ = polytrain.load(tmp_path / "run")
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)
    assert main(["convert", "--to", "peft", str(tmp_path / "run"), str(tmp_path / "back")]) == 0
    back = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "back").eval()
    torch.testing.assert_close(_logits(back, ids), want, rtol=1e-5, atol=1e-5)
    first, again = load_file(tmp_path / "peft" / "adapter_model.safetensors"), \
        load_file(tmp_path / "back" / "adapter_model.safetensors")
    if case == "llama":
        assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    else:  # c_attn: PEFT's one adapter of q, k, v became three, stacked back at rank 3 x 4
        config = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
        assert set(config["rank_pattern"].values()) == {12}
        import_peft(tmp_path / "back", tmp_path / "run2", base)
        a, b = read_model_tensors(tmp_path / "run" / "checkpoints" / "step_0"), \
            read_model_tensors(tmp_path / "run2" / "checkpoints" / "step_0")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["convert", "--to", "hf", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(_logits(merged, ids), want, rtol=1e-5, atol=1e-5)


def test_fine_tunes_from_imported_adapters_and_in_place(tmp_path, gpt2_with_tokenizer, small_corpus):
    from polytrain.train.trainer import Trainer

    base = import_hf(tmp_path / "hf", tmp_path / "base")
    adapted = peft.get_peft_model(copy.deepcopy(gpt2_with_tokenizer),
                                  peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS["gpt2"]))
    adapted.save_pretrained(tmp_path / "peft")
    run = import_peft(tmp_path / "peft", tmp_path / "run", base)
    overrides = ["--data.source", str(small_corpus), "--data.seq_len", "32", "--run.sample_tokens", "0",
                 "--run.eval_batches", "1", "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
                 "--checkpoint.keep", "1"]
    base_step0 = base / "checkpoints" / "step_0"
    # The imported adapters resume on the base they name.
    trainer = Trainer(load_config(run / "config.toml", overrides + ["--run.steps", "1"]))
    assert trainer.step == 0
    trainer.train()
    assert read_state(run / "checkpoints" / "step_1").base == str(base_step0.resolve())
    # LoRA on the imported run itself: its step_0 is the base of the adapters-only step_2, kept.
    trainer = Trainer(load_config(base / "config.toml", overrides + ["--run.steps", "2", "--lora.rank", "4"]))
    trainer.train()
    final = base / "checkpoints" / "step_2"
    assert read_state(final).base == str(base_step0.resolve()) and base_step0.is_dir()
    saved = read_model_tensors(final)
    assert saved and all(k.endswith((".lora_a", ".lora_b")) for k in saved)
    model, tokenizer = polytrain.load(base)  # the adapters merged into their base
    assert main(["convert", "--to", "hf", str(base), str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.tensor([tokenizer.encode("def main():")])
    torch.testing.assert_close(_logits(model, ids), _logits(merged, ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_logits(merged, ids), _logits(gpt2_with_tokenizer, ids))  # the adapters moved


def test_peft_errors_name_the_problem(tmp_path, capsys, small_corpus):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    assert main(["convert", str(tmp_path / "adapter"), str(tmp_path / "out")]) == 2
    assert "name the polytrain run or checkpoint of its base model with --base" in capsys.readouterr().err
    from polytrain.train.trainer import Trainer

    Trainer(load_config(None, tiny_overrides(small_corpus, tmp_path / "plain", run__steps=1))).train()
    assert main(["convert", "--to", "peft", str(tmp_path / "plain"), str(tmp_path / "x")]) == 2
    assert "holds no LoRA adapters" in capsys.readouterr().err
    # LoRA in place on a trained run: its step_1 would outrank the adapters' own steps at a resume.
    with pytest.raises(CheckpointError, match="start the LoRA run in a directory of its own"):
        Trainer(load_config(None, tiny_overrides(small_corpus, tmp_path / "plain", run__steps=2, lora__rank=4)))
