"""Load a model for inference: a polytrain run (config.toml, tokenizer.json, newest checkpoint),
one of its checkpoints, or a Hugging Face model directory.

    model, tokenizer = polytrain.load("runs/default")        # or runs/x/checkpoints/step_200, or an HF dir
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from polytrain.backend import get_accelerator
from polytrain.checkpoint import STATE_FILE, RunDir, latest_checkpoint, load_model_weights
from polytrain.checkpoint.trainer_state import read_state
from polytrain.config import Config, LoRAConfig, load_config
from polytrain.data.tokenizer import Tokenizer
from polytrain.errors import CheckpointError, ConfigError
from polytrain.inference.generate import generate, generate_seq2seq
from polytrain.lora import apply_lora, merge_adapters
from polytrain.models import ARCHITECTURES


@dataclass
class LoadedRun:
    cfg: Config
    model: torch.nn.Module
    tokenizer: Tokenizer
    checkpoint: Path


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None) -> LoadedRun:
    """The model of `run_dir` with the weights of `checkpoint` (default: the newest), on one device;
    a checkpoint's LoRA adapters (and their base) are loaded and merged into the weights."""
    run = RunDir(run_dir)
    cfg = load_config(run.require_config())
    path = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"{run_dir} has no complete checkpoint under checkpoints/")
    device = get_accelerator().device()
    with torch.device("meta"):  # no random init of weights about to be overwritten
        model = ARCHITECTURES[cfg.model.arch].build(cfg.model)
    lora = read_state(path).lora
    if lora is not None:
        apply_lora(model, LoRAConfig(**lora))
    model.to_empty(device=device)
    model.init_buffers()
    load_model_weights(path, model)
    if lora is not None:
        merge_adapters(model)
    return LoadedRun(cfg, model.eval(), Tokenizer.load(run.tokenizer), path)


def load(path: str | Path, device: torch.device | str | None = None):
    """(model, tokenizer) from a run directory, a checkpoint step_<N> directory or a Hugging Face
    model directory (converted in memory); the model in eval mode on `device` (default: the
    accelerator's). The tokenizer is None for an HF directory without tokenizer.json."""
    from polytrain.convert import load_hf

    path = Path(path)
    if RunDir(path).config.is_file():
        run = load_run(path)
    elif (path / STATE_FILE).is_file():
        run = load_run(path.parent.parent, path)
    elif (path / "config.json").is_file():
        return load_hf(path, device or get_accelerator().device())
    else:
        raise ConfigError(f"{path} is not a polytrain run, a checkpoint or a Hugging Face model directory "
                          "(no config.toml, trainer.json or config.json)")
    return (run.model.to(device) if device is not None else run.model), run.tokenizer


def generate_text(run: LoadedRun, prompt: str, max_new_tokens: int, *, temperature: float = 0.8,
                  top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                  generate_fn=generate) -> str:
    """`prompt` followed by up to `max_new_tokens` sampled tokens (fewer if the model's context ends);
    for an encoder-decoder, the decoder's text for the encoded prompt. An empty prompt starts
    from end-of-text, the token between training documents: the sample is a new document.
    `generate_fn`: a decoder's sampler with inference.generate's contract (cp_generate_fn's
    over a cp group)."""
    kind = ARCHITECTURES[run.cfg.model.arch].kind
    if kind == "encoder":
        raise ConfigError(f"text generation needs a decoder or an encoder-decoder; {run.cfg.model.arch} "
                          "is an encoder (masked LM)")
    ids = run.tokenizer.encode(prompt) or [run.tokenizer.eot_id]
    device = next(run.model.parameters()).device
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stop_tokens(run.tokenizer),
                    generator=torch.Generator(device=device).manual_seed(seed))
    if kind == "encoder-decoder":
        start = ARCHITECTURES[run.cfg.model.arch].decoder_start
        new = generate_seq2seq(run.model, [ids], max_new_tokens, start_token=start, **sampling)
        return run.tokenizer.decode(new[0])
    room = run.cfg.model.max_seq_len - len(ids)
    if room <= 0:
        raise ConfigError(f"the prompt is {len(ids)} tokens; this model's context is {run.cfg.model.max_seq_len}")
    new = generate_fn(run.model, [ids], min(max_new_tokens, room), **sampling)
    return prompt + run.tokenizer.decode(new[0])


# End-of-turn tokens of common chat formats (ChatML's, Llama 3's), besides end-of-text.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>")


def stop_tokens(tokenizer: Tokenizer) -> set[int]:
    """End-of-text and, where the vocabulary has them, the end-of-turn tokens of chat formats."""
    ids = {tokenizer.hf.token_to_id(name) for name in _END_OF_TURN}
    return {tokenizer.eot_id} | {i for i in ids if i is not None}
