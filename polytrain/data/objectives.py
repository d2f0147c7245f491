"""Pre-training objectives: what the model reads and what the loss scores, from packed token windows.

    objective = build_objective(cfg, eos_id=tokenizer.eot_id)
    args, targets = objective.batch(inputs, targets, indices)   # then loss(model(*args), targets)

- causal (decoders): next-token prediction, the window as it is.
- mlm (BERT): a fixed 15% of each sequence's positions are scored; of those 80% become
  [MASK], 10% a random token, 10% stay (BERT's rule, and its fixed count per sequence).
- span (T5): span corruption. A fixed 15% of each sequence, in spans of mean length 3,
  is cut out; the encoder reads the rest with one sentinel per cut span, the decoder
  writes each sentinel followed by its span, then end-of-text.

Special ids come from the tokenizer when it has them ([MASK]; T5's <extra_id_k>, as
converted BERT and T5 tokenizers do); otherwise they sit at the top of the model's
vocabulary, which the tokenizer then leaves free (`reserved_ids`): [MASK] is
vocab_size - 1, sentinel k is vocab_size - 1 - k. Targets of -100 are not scored.

Randomness is drawn per sample from (run seed, sample index), so masks do not depend on
the layout or the order samples are seen; and every sequence of a batch gets the same
number of scored tokens, so the mean over micro-batch means stays the global mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polytrain.config import Config
from polytrain.errors import ConfigError
from polytrain.models import ARCHITECTURES
from polytrain.models.common.init import seed_for
from polytrain.models.registry import objective_name

IGNORE = -100  # F.cross_entropy's ignore_index


def span_counts(length: int, density: float, mean_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) that span corruption cuts from a sequence of `length`."""
    noise = min(max(round(length * density), 1), length - 1)
    return noise, max(round(noise / mean_span), 1)


def _special_ids(cfg: Config, tokenizer) -> list[int] | None:
    """The objective's special ids as the tokenizer defines them, or None if it has not all of them."""
    name = objective_name(cfg)
    if name == "mlm":
        names = ["[MASK]"]
    elif name == "span":
        names = [f"<extra_id_{k}>" for k in range(_spans(cfg))]
    else:
        return []
    ids = [tokenizer.hf.token_to_id(n) for n in names] if tokenizer is not None else [None]
    return None if None in ids else ids


def _spans(cfg: Config) -> int:
    return span_counts(cfg.data.seq_len, cfg.data.mask_fraction, cfg.data.mean_span_length)[1]


def reserved_ids(cfg: Config) -> int:
    """Ids at the top of the model vocabulary the objective takes, so a trained tokenizer must not."""
    tokenizer = None
    if cfg.data.tokenizer != "bpe":
        from polytrain.data.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(cfg.data.tokenizer)
    if _special_ids(cfg, tokenizer) is not None:
        return 0
    return 1 if objective_name(cfg) == "mlm" else _spans(cfg)


def build_objective(cfg: Config, tokenizer):
    """The objective of this run's architecture (train.objective) for its data and tokenizer."""
    if cfg.model.head != "lm":
        raise ConfigError("model.head = 'value' models learn from preferences, not a pre-training objective: "
                          "train them with `polytrain rlhf` (step 2), or set model.head = 'lm'")
    name, vocab, seed = objective_name(cfg), cfg.model.vocab_size, cfg.run.seed
    special = _special_ids(cfg, tokenizer) or [vocab - 1 - k for k in range(_spans(cfg))]
    if name == "mlm":
        return MaskedLM(special[0], tokenizer.vocab_size, cfg.data.mask_fraction, seed)
    if name == "span":
        return SpanCorruption(special, cfg.data.mask_fraction, cfg.data.mean_span_length, seed,
                              tokenizer.eot_id, ARCHITECTURES[cfg.model.arch].decoder_start)
    return CausalLM()


class CausalLM:
    name = "causal"

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor, indices: Sequence[int]):
        """((inputs (B, T),), targets (B, T)): the window and the window shifted by one."""
        return (inputs,), targets


def _generator(seed: int, what: str, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed_for(seed, f"{what}:{index}"))


class MaskedLM:
    """BERT's masked language model: 15% of positions scored, 80/10/10 [MASK]/random/kept."""

    name = "mlm"

    def __init__(self, mask_id: int, n_tokens: int, fraction: float, seed: int):
        """mask_id: [MASK]; random replacements are drawn from ids 0..n_tokens-1 (the tokenizer's)."""
        self.mask_id, self.n_random = mask_id, n_tokens
        self.fraction, self.seed = fraction, seed

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor, indices: Sequence[int]):
        """((corrupted (B, T),), labels (B, T): the original token where scored, else -100)."""
        corrupted, labels = inputs.clone(), torch.full_like(inputs, IGNORE)
        T = inputs.shape[1]
        n = min(max(round(T * self.fraction), 1), T)
        for row, index in enumerate(indices):
            g = _generator(self.seed, "mlm", index)
            picked = torch.randperm(T, generator=g)[:n]  # (n,) positions to score
            labels[row, picked] = inputs[row, picked]
            roll = torch.rand(n, generator=g)
            masked, randomized = picked[roll < 0.8], picked[(roll >= 0.8) & (roll < 0.9)]
            corrupted[row, masked] = self.mask_id
            corrupted[row, randomized] = torch.randint(0, self.n_random, (len(randomized),), generator=g)
        return (corrupted,), labels


class SpanCorruption:
    """T5's span corruption with sentinels; every sequence gives the same encoder and decoder lengths."""

    name = "span"

    def __init__(self, sentinels: list[int], density: float, mean_span: float, seed: int, eos_id: int,
                 decoder_start: int = 0):
        """sentinels[k]: the id that stands for the k-th cut span; eos_id ends the targets;
        decoder_start: the id the decoder's input starts with (T5's: 0)."""
        self.sentinels, self.density, self.mean_span = sentinels, density, mean_span
        self.seed, self.eos_id, self.decoder_start = seed, eos_id, decoder_start

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor, indices: Sequence[int]):
        """((encoder input (B, T - noise + spans), decoder input (B, noise + spans + 1)), targets).

        The decoder input is the targets shifted right behind the start token.
        """
        T = inputs.shape[1]
        noise, spans = span_counts(T, self.density, self.mean_span)
        enc, dec = [], []
        for row, index in zip(inputs.tolist(), indices):
            g = _generator(self.seed, "span", index)
            noise_lens = _split(noise, spans, g)
            keep_lens = _split(T - noise, spans, g)
            e, d, pos = [], [], 0
            for k, (keep, cut) in enumerate(zip(keep_lens, noise_lens)):
                e += row[pos:pos + keep] + [self.sentinels[k]]  # kept text, then the sentinel of the cut
                d += [self.sentinels[k]] + row[pos + keep:pos + keep + cut]
                pos += keep + cut
            enc.append(e)
            dec.append(d + [self.eos_id])
        targets = torch.tensor(dec)  # (B, noise + spans + 1)
        start = torch.full((len(dec), 1), self.decoder_start)
        return (torch.tensor(enc), torch.cat([start, targets[:, :-1]], 1)), targets


def _split(total: int, parts: int, g: torch.Generator) -> list[int]:
    """`total` split into `parts` positive lengths at random (parts - 1 distinct cut points)."""
    cuts = (torch.randperm(total - 1, generator=g)[:parts - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]
