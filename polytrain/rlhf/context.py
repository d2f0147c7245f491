"""What the three steps of one `polytrain rlhf` run share: the world, the data, the tokenizer, the actor's start.

    run = RLHFRun.open(cfg, acc, world)      # collective: rank 0 makes the tokenizer, the others load it
    run.phase("reward")                      # step 2's rows and its held-out rows
    run.encoder.pair(row), run.scorer        # token ids; the true metric (None for a user's data)

The run's tokenizer is made once and kept at runs/<name>/tokenizer.json, so every step and
every resume reads the same ids: the actor's own (rlhf.actor_from), else a byte-level BPE
trained to model.vocab_size on the task's text (the built-in task's, or the rows of
rlhf.data).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from polytrain.backend.base import Accelerator
from polytrain.checkpoint import RunDir
from polytrain.config import Config
from polytrain.data.preference import PhaseData, parse_split, phase_data
from polytrain.data.tokenizer import Tokenizer, train_bpe
from polytrain.distributed.world import World, barrier
from polytrain.errors import ConfigError
from polytrain.rlhf.batches import Encoder, PromptFormat
from polytrain.rlhf.sources import Start, actor_start
from polytrain.rlhf.task import Scorer, TaskData, builtin_tokenizer, task_data


def _texts(data: TaskData) -> list[str]:
    """Every text of the rows, for training the run's tokenizer on them."""
    return [t for s in data.sources for r in s.rows for t in (r.prompt, r.chosen, r.rejected, r.response) if t]


def _tokenizer(cfg: Config, data: TaskData, actor: Start) -> Tokenizer:
    if actor.tokenizer is not None:
        return Tokenizer.load(actor.tokenizer)
    if cfg.rlhf.actor_from:
        raise ConfigError(f"rlhf.actor_from = {cfg.rlhf.actor_from!r} has no tokenizer.json; the run reads the "
                          "actor's tokens with the actor's tokenizer: add it to that directory")
    if not cfg.rlhf.data:
        return builtin_tokenizer(actor.model.vocab_size)
    return train_bpe(_texts(data), actor.model.vocab_size)


@dataclass
class RLHFRun:
    """The shared state of one run on every rank (module docstring)."""

    cfg: Config
    acc: Accelerator
    world: World
    data: TaskData
    actor: Start
    tokenizer: Tokenizer
    encoder: Encoder

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    @property
    def scorer(self) -> Scorer | None:
        return self.data.scorer

    @property
    def pad_id(self) -> int:
        return self.tokenizer.eot_id

    @classmethod
    def open(cls, cfg: Config, acc: Accelerator, world: World) -> RLHFRun:
        """Read the data, resolve the actor, make (rank 0) or load the tokenizer; collective."""
        r = cfg.rlhf
        data = task_data([p for p in r.data.split(",") if p.strip()],
                         [float(w) for w in r.data_weights.split(",") if w.strip()] or None,
                         cfg.run.seed, r.task_pairs, r.task_demos, r.task_noise)
        actor = actor_start(cfg, cfg.run_dir)
        saved = RunDir(cfg.run_dir).tokenizer
        if world.is_main and not saved.is_file():
            saved.parent.mkdir(parents=True, exist_ok=True)
            _tokenizer(cfg, data, actor).save(saved)
        barrier()
        tokenizer = Tokenizer.load(saved)
        if tokenizer.vocab_size > actor.model.vocab_size:
            raise ConfigError(f"the run's tokenizer ({saved}) has {tokenizer.vocab_size} ids, the actor's vocabulary "
                              f"model.vocab_size = {actor.model.vocab_size}; raise it, or start a new run")
        eos = tokenizer.hf.id_to_token(tokenizer.eot_id)
        fmt = PromptFormat(r.prompt_template, actor.chat_template, eos)
        encoder = Encoder(tokenizer, fmt, cfg.data.seq_len, r.max_prompt_len)
        return cls(cfg, acc, world, data, actor, tokenizer, encoder)

    def phase(self, step: str) -> PhaseData:
        """Step `step`'s blended rows, with rlhf.eval_rows of them held out (step 1 holds out as many)."""
        r = self.cfg.rlhf
        return phase_data(self.data.sources, parse_split(r.data_split), step, self.cfg.run.seed, r.eval_rows)
