"""Where step 1's actor and step 2's reward model start: a preset, a polytrain run, or a Hugging Face model.

    rlhf.actor_from  = ""                the [model] section: a preset, weights seeded by name
                     = runs/pretrained   a polytrain run directory: its model, tokenizer, newest checkpoint
                     = /models/llama-hf  a Hugging Face directory, imported once into runs/<name>/base/actor
    rlhf.reward_from = ""                the SFT actor (same model, its weights; the output row replaced)
                     = 350m              a size preset of the actor's architecture (a smaller reward model)
                     = a run or HF dir   as above; its vocabulary must be the actor's

A reward model (and the critic, which starts from it) is the same decoder with a value head
(`model.head = "value"`), so every layout, checkpoint and initialisation rule applies to it.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

from polytrain.checkpoint import RunDir, latest_checkpoint
from polytrain.config import Config, ModelConfig, load_config
from polytrain.convert import import_hf, model_config_from_hf
from polytrain.errors import ConfigError
from polytrain.inference.chat import chat_template
from polytrain.io.hf_files import HFTensors, read_config
from polytrain.models import ARCHITECTURES
from polytrain.models.common.value_head import HEAD
from polytrain.models.registry import model_config, resolve_model

BASE = "base"
"""runs/<name>/base/<role>/: Hugging Face models imported as polytrain run directories."""


@dataclass(frozen=True)
class Start:
    """A model to start a step from: its config and, unless seeded by name, the checkpoint to load."""

    model: ModelConfig
    checkpoint: Path | None = None
    directory: Path | None = None
    """The run directory it comes from (its tokenizer.json and chat template), if any."""
    skip: tuple[str, ...] = ()
    """Parameters the checkpoint holds in another shape, left to their name-seeded values: the
    output row of a value model started from a language model's checkpoint."""

    @property
    def tokenizer(self) -> Path | None:
        path = RunDir(self.directory).tokenizer if self.directory else None
        return path if path is not None and path.is_file() else None

    @property
    def chat_template(self) -> str | None:
        return chat_template(self.directory) if self.directory else None


def _is_hf(path: Path) -> bool:
    return (path / "config.json").is_file() and not RunDir(path).config.is_file()


def _imported(run_dir: Path, role: str) -> Path:
    return Path(run_dir) / BASE / role


def directory_model(path: Path, key: str) -> ModelConfig:
    """The model config of a polytrain run or HF directory, without loading weights (cheap)."""
    if RunDir(path).config.is_file():
        return load_config(RunDir(path).config).model
    if _is_hf(path):
        return model_config_from_hf(read_config(path), set(HFTensors(path)))
    raise ConfigError(f"{key} = {str(path)!r} is not a polytrain run directory (config.toml) or a Hugging Face "
                      "model directory (config.json); give one, or leave it empty")


def import_if_hf(path_text: str, run_dir: Path, role: str) -> None:
    """Import an HF directory into runs/<name>/base/<role> once (one process, before the workers join)."""
    path = Path(path_text)
    dest = _imported(run_dir, role)
    if path_text and _is_hf(path) and latest_checkpoint(dest) is None:
        if dest.exists():  # an import cut short: start it again
            shutil.rmtree(dest)
        import_hf(path, dest)


def _from_directory(path_text: str, key: str, run_dir: Path, role: str) -> Start:
    path = Path(path_text)
    directory = _imported(run_dir, role) if _is_hf(path) else path
    model = directory_model(directory if directory.exists() else path, key)
    checkpoint = latest_checkpoint(directory)
    if checkpoint is None:
        raise ConfigError(f"{key} = {path_text!r} holds no complete checkpoint under checkpoints/; "
                          "train it first or point at a run that has one")
    return Start(model, checkpoint, directory)


def actor_start(cfg: Config, run_dir: Path) -> Start:
    """Step 1's actor: the [model] section with name-seeded weights, or rlhf.actor_from's model."""
    if not cfg.rlhf.actor_from:
        return Start(dataclasses.replace(cfg.model, head="lm"))
    start = _from_directory(cfg.rlhf.actor_from, "rlhf.actor_from", run_dir, "actor")
    if ARCHITECTURES[start.model.arch].kind != "decoder" or start.model.head != "lm":
        raise ConfigError(f"rlhf.actor_from: the actor must be a decoder language model (llama, gpt2, "
                          f"internlm2), not {start.model.arch} with model.head = '{start.model.head}'")
    return start


def planned_models(cfg: Config) -> tuple[ModelConfig, ModelConfig]:
    """(actor, reward model) configs as the steps will build them, read without loading any weights:
    what the start-up check needs before the workers start."""
    actor = directory_model(Path(cfg.rlhf.actor_from), "rlhf.actor_from") if cfg.rlhf.actor_from else cfg.model
    actor = dataclasses.replace(actor, head="lm")
    text = cfg.rlhf.reward_from
    if not text:
        return actor, value_model(actor)
    if text in ARCHITECTURES[actor.arch].presets:
        return actor, reward_start(cfg, actor, None, cfg.run_dir).model
    return actor, value_model(directory_model(Path(text), "rlhf.reward_from"))


def value_model(model: ModelConfig) -> ModelConfig:
    """The same decoder with a value head (untied: the head is its own (1, dim) weight)."""
    return dataclasses.replace(model, head="value", tie_embeddings=False)


def reward_start(cfg: Config, actor: ModelConfig, sft_checkpoint: Path | None, run_dir: Path) -> Start:
    """Step 2's reward model (rlhf.reward_from, module docstring); `sft_checkpoint` is step 1's final one."""
    text = cfg.rlhf.reward_from
    if not text:
        return Start(value_model(actor), sft_checkpoint, skip=(f"{HEAD}.weight",))
    arch = ARCHITECTURES[actor.arch]
    if text in arch.presets:
        preset = Config(model=model_config(actor.arch, size=text, vocab_size=actor.vocab_size,
                                           max_seq_len=actor.max_seq_len, tie_embeddings=False))
        resolve_model(preset)
        return Start(value_model(preset.model))
    start = _from_directory(text, "rlhf.reward_from", run_dir, "reward")
    if start.model.vocab_size != actor.vocab_size:
        raise ConfigError(f"rlhf.reward_from = {text!r} has a vocabulary of {start.model.vocab_size} tokens, the "
                          f"actor {actor.vocab_size}; the reward model reads the actor's tokens: use a model "
                          f"with the actor's tokenizer, or a size preset ({', '.join(arch.presets)})")
    skip = (f"{HEAD}.weight",) if start.model.head == "lm" else ()  # a reward model's own head loads as it is
    return Start(value_model(start.model), start.checkpoint, start.directory, skip)
