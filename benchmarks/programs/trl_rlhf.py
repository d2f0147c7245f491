"""TRL's side of benchmarks/rlhf_vs_trl.py: its RewardTrainer, then its GRPOTrainer, on what polytrain trained on.

    /path/to/venv-with-trl/bin/python benchmarks/programs/trl_rlhf.py reward OUT
    /path/to/venv-with-trl/bin/python benchmarks/programs/trl_rlhf.py grpo OUT

Runs in a Python that has trl (TRL is not a polytrain dependency) and imports nothing of polytrain. The
driver leaves in OUT:
    sft_hf/         the SFT actor, exported by `polytrain convert --to hf`
    rows.json       {"reward_train": [{prompt, chosen, rejected}], "reward_held_out": [...], "ppo_prompts": [str],
                    "ppo_held_out": [str]}, step 2's and step 3's rows exactly as polytrain split them
    settings.json   the hyperparameters (steps, batch sizes, rates, group size, lengths, seed)
`reward` trains a LlamaForSequenceClassification started from sft_hf with TRL's RewardTrainer, scores the
held-out pairs (accuracy: chosen above rejected) and writes OUT/trl_rm and OUT/trl_reward.json; `grpo` trains
sft_hf with TRL's GRPOTrainer against OUT/trl_rm and writes OUT/trl_grpo.json, with one sampled response per
held-out step-3 prompt before and after training (the driver scores them with the task's true metric).
Speeds are samples (pairs, or sampled responses) per second over the optimizer steps after the first, as the
driver measures polytrain.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _steps_per_s(stamps: list[float], samples_per_step: int) -> float:
    """Samples/s from the end times of the optimizer steps, leaving out the first step (set-up, warm-up)."""
    if len(stamps) < 2:
        raise SystemExit("trl_rlhf: fewer than 2 optimizer steps ran; give more steps")
    return (len(stamps) - 1) * samples_per_step / (stamps[-1] - stamps[0])


class _Stamps:
    """A TrainerCallback (built lazily, transformers is imported late) recording when each optimizer step ends."""

    def __new__(cls, stamps: list[float]):
        from transformers import TrainerCallback

        class StepClock(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                stamps.append(time.perf_counter())

        return StepClock()


def _tokenizer(hf: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _common(s: dict, out: Path, name: str) -> dict:
    """TrainingArguments both trainers share: the config's schedule and optimizer, CPU, fp32, no saving."""
    return dict(output_dir=str(out / name), max_steps=s["steps"], warmup_steps=s["warmup_steps"],
                lr_scheduler_type="cosine", weight_decay=s["weight_decay"], adam_beta1=s["beta1"],
                adam_beta2=s["beta2"], max_grad_norm=s["grad_clip"] or 1e9, logging_steps=1, report_to=[],
                save_strategy="no", use_cpu=True, bf16=False, fp16=False, seed=s["seed"], dataloader_num_workers=0)


def held_out_accuracy(model, tok, pairs: list[dict]) -> float:
    """Share of pairs whose chosen answer the model scores above the rejected one, each text ending in EOS as
    in training (the sequence-classification head reads the last token before padding)."""
    import torch

    right = 0
    model.eval()
    with torch.no_grad():
        for row in pairs:
            texts = [row["prompt"] + row[k] + tok.eos_token for k in ("chosen", "rejected")]
            enc = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
            scores = model(**enc).logits[:, 0]
            right += int(scores[0] > scores[1])
    return right / len(pairs)


def sample(model, tok, prompts: list[str], s: dict, batch: int = 64) -> list[str]:
    """One response per prompt, sampled as the rollouts are (temperature, all tokens, up to max_new_tokens),
    decoded without the end-of-text; the driver scores them with the task's true metric."""
    import torch

    model.eval()
    texts = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True, padding_side="left",
                      add_special_tokens=False)
            ids = model.generate(**enc, do_sample=True, temperature=s["temperature"], top_k=0, top_p=1.0,
                                 max_new_tokens=s["max_new_tokens"], pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
            texts += tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts


def run_reward(out: Path, s: dict, rows: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    torch.manual_seed(s["seed"])
    tok = _tokenizer(out / "sft_hf")
    model = AutoModelForSequenceClassification.from_pretrained(out / "sft_hf", num_labels=1,
                                                               pad_token_id=tok.pad_token_id)
    train = Dataset.from_list(rows["reward_train"])
    batch, micro = s["reward_batch"], s["micro_batch"]
    args = RewardConfig(per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
                        learning_rate=s["reward_lr"],
                        **_common(s, out, "trl_rm_run"))
    stamps: list[float] = []
    trainer = RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tok,
                            callbacks=[_Stamps(stamps)])
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    accuracy = held_out_accuracy(model, tok, rows["reward_held_out"])
    model.save_pretrained(out / "trl_rm")
    tok.save_pretrained(out / "trl_rm")
    return {"steps": s["steps"], "accuracy": accuracy, "samples_per_s": _steps_per_s(stamps, batch),
            "train_s": seconds, "held_out_pairs": len(rows["reward_held_out"])}


def run_grpo(out: Path, s: dict, rows: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl import GRPOConfig, GRPOTrainer

    if not (out / "trl_rm").is_dir():
        raise SystemExit(f"trl_rlhf grpo: {out / 'trl_rm'} is missing; run `trl_rlhf.py reward {out}` first")
    torch.manual_seed(s["seed"])
    tok = _tokenizer(out / "sft_hf")
    actor = AutoModelForCausalLM.from_pretrained(out / "sft_hf")
    reward = AutoModelForSequenceClassification.from_pretrained(out / "trl_rm", num_labels=1,
                                                                pad_token_id=tok.pad_token_id)
    prompts = Dataset.from_list([{"prompt": p} for p in rows["ppo_prompts"]])
    batch, micro = s["grpo_batch"], s["micro_batch"]
    args = GRPOConfig(per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
                      num_generations=s["group_size"], max_completion_length=s["max_new_tokens"],
                      temperature=s["temperature"], top_k=0, top_p=1.0, beta=s["kl_coef"], epsilon=s["policy_clip"],
                      num_iterations=1, loss_type="dapo", scale_rewards="group", learning_rate=s["actor_lr"],
                      **_common(s, out, "trl_grpo_run"))
    held_out = rows["ppo_held_out"]
    before = sample(actor, tok, held_out, s)
    actor.train()
    stamps: list[float] = []
    trainer = GRPOTrainer(model=actor, reward_funcs=reward, args=args, train_dataset=prompts, processing_class=tok,
                          reward_processing_classes=tok, callbacks=[_Stamps(stamps)])
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logged = [r for r in trainer.state.log_history if "reward" in r]
    after = sample(trainer.model, tok, held_out, s)
    return {"steps": s["steps"], "samples_per_s": _steps_per_s(stamps, batch), "train_s": seconds,
            "reward_first": logged[0]["reward"] if logged else None,
            "reward_last": logged[-1]["reward"] if logged else None,
            "held_out_before": before, "held_out_after": after}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("reward", "grpo"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    kind, out = argv[0], Path(argv[1])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = json.loads((out / "settings.json").read_text())
    rows = json.loads((out / "rows.json").read_text())
    s = {**settings, "steps": settings[f"{kind}_steps"]}
    result = run_reward(out, s, rows) if kind == "reward" else run_grpo(out, s, rows)
    (out / f"trl_{kind}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
