"""Load a trained run (config.toml, tokenizer.json, newest checkpoint) for generation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from polytrain.backend import get_accelerator
from polytrain.config import Config, load_config
from polytrain.data.tokenizer import Tokenizer
from polytrain.errors import CheckpointError, ConfigError
from polytrain.inference.generate import generate
from polytrain.models import ARCHITECTURES
from polytrain.train.checkpoint import latest_checkpoint, load_model_weights


@dataclass
class LoadedRun:
    cfg: Config
    model: torch.nn.Module
    tokenizer: Tokenizer
    checkpoint: Path


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None) -> LoadedRun:
    """The model of `run_dir` with the weights of `checkpoint` (default: the newest), on one device."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"{run_dir} is not a polytrain run directory (no config.toml)")
    cfg = load_config(run_dir / "config.toml")
    path = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"{run_dir} has no complete checkpoint under checkpoints/")
    device = get_accelerator().device()
    with torch.device(device):
        model = ARCHITECTURES[cfg.model.arch].build(cfg.model)
    load_model_weights(path, model)
    return LoadedRun(cfg, model.eval(), Tokenizer.load(run_dir / "tokenizer.json"), path)


def generate_text(run: LoadedRun, prompt: str, max_new_tokens: int, *, temperature: float = 0.8,
                  top_k: int | None = None, top_p: float | None = None, seed: int = 0) -> str:
    """`prompt` followed by up to `max_new_tokens` sampled tokens (fewer if the model's context ends)."""
    ids = run.tokenizer.encode(prompt)
    room = run.cfg.model.max_seq_len - len(ids)
    if room <= 0:
        raise ConfigError(f"the prompt is {len(ids)} tokens; this model's context is {run.cfg.model.max_seq_len}")
    device = next(run.model.parameters()).device
    new = generate(run.model, [ids], min(max_new_tokens, room), temperature=temperature, top_k=top_k,
                   top_p=top_p, stop_tokens={run.tokenizer.eot_id},
                   generator=torch.Generator(device=device).manual_seed(seed))
    return prompt + run.tokenizer.decode(new[0])
