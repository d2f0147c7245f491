"""Rows -> token ids -> right-padded batches for the three steps.

A row's prompt becomes text through the prompt format (`rlhf.prompt_template`): a
template with `{prompt}` (default "{prompt}": DeepSpeed-Chat's rows already carry
" Human: ... Assistant:"), or "chat" for the chat template of the actor's tokenizer.
The prompt and the response are tokenized separately and joined, followed by the
end-of-text token, so a response scored in training is the very token sequence step 3
generates after the same prompt.

Batches are right-padded: every row starts at position 0, so causal attention never
sees the padding and no attention mask is needed; per-token tensors are the shifted
(B, T - 1) layout of `losses` (position t scores token t + 1).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from polytrain.data.preference import Row
from polytrain.data.tokenizer import Tokenizer
from polytrain.errors import ConfigError
from polytrain.inference.chat import render

IGNORE = -100  # F.cross_entropy's ignore_index


class PromptFormat:
    """A row's prompt -> the text the model reads before its response."""

    def __init__(self, template: str, chat_template: str | None = None, eos: str = ""):
        if template == "chat":
            if not chat_template:
                raise ConfigError("rlhf.prompt_template = 'chat' needs a chat template in the actor's "
                                  "tokenizer_config.json; the actor has none: use a template with {prompt}")
        elif "{prompt}" not in template:
            raise ConfigError(f"rlhf.prompt_template = {template!r} must contain {{prompt}} or be 'chat'")
        self.template, self.chat_template, self.eos = template, chat_template, eos

    @property
    def is_chat(self) -> bool:
        return self.template == "chat"

    def __call__(self, prompt: str) -> str:
        if self.is_chat:
            return render(self.chat_template, [{"role": "user", "content": prompt}], eos=self.eos)
        return self.template.replace("{prompt}", prompt)


DS_CHAT_TURN = " Human: {prompt} Assistant:"
"""DeepSpeed-Chat's turn format, which its rows' prompts already carry."""


def chat_template_for(template: str) -> str:
    """A Jinja chat template that renders each user turn as training rendered a prompt, for `polytrain chat`
    of an actor without one: `template` around the message, or DeepSpeed-Chat's turn for "{prompt}"."""
    turn = DS_CHAT_TURN if template == "{prompt}" else template
    before, _, after = turn.partition("{prompt}")
    return ("{% for m in messages %}{% if m['role'] == 'user' %}{{ " + json.dumps(before) + " }}{{ m['content'] }}"
            "{{ " + json.dumps(after) + " }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")


@dataclass
class Encoder:
    """Token ids of rows under one tokenizer, prompt format and length limits."""

    tokenizer: Tokenizer
    fmt: PromptFormat
    seq_len: int
    """Longest prompt + response + end-of-text; responses are cut to fit (DeepSpeed-Chat truncates)."""
    max_prompt_len: int
    """Longest prompt in tokens; a longer one is an error naming its row."""

    def prompt(self, row: Row) -> list[int]:
        """The prompt's ids; ConfigError when it is longer than max_prompt_len."""
        text = self.fmt(row.prompt)
        ids = self.tokenizer.encode_chat(text) if self.fmt.is_chat else self.tokenizer.encode(text)
        if len(ids) > self.max_prompt_len or len(ids) >= self.seq_len:
            limit = min(self.max_prompt_len, self.seq_len - 1)
            raise ConfigError(f"rlhf.data: the prompt of {row.where or 'a row'} is {len(ids)} tokens, over the "
                              f"limit of {limit} (rlhf.max_prompt_len, below data.seq_len); shorten "
                              "it or raise the limit")
        return ids

    def with_response(self, prompt_ids: list[int], response: str) -> list[int]:
        """prompt + response + end-of-text, cut at seq_len."""
        ids = prompt_ids + self.tokenizer.encode(response) + [self.tokenizer.eot_id]
        return ids[: self.seq_len]

    def sft(self, row: Row) -> tuple[list[int], int]:
        """(ids, prompt length) of a demonstration: the row's response, or a pair's chosen answer."""
        p = self.prompt(row)
        return self.with_response(p, row.response if not row.is_pair else row.chosen), len(p)

    def pair(self, row: Row) -> tuple[list[int], list[int]]:
        """(chosen ids, rejected ids) of a preference row."""
        p = self.prompt(row)
        return self.with_response(p, row.chosen), self.with_response(p, row.rejected)


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T), lengths (B,)): each sequence followed by pad_id up to T (default the longest)."""
    T = length or max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return ids, torch.tensor([len(s) for s in seqs])


def response_mask(prompt_lens: torch.Tensor, lengths: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T - 1) True where shifted position t scores a response token (t + 1 in [prompt, length))."""
    pos = torch.arange(T - 1)[None, :]  # (1, T - 1): position t predicts token t + 1
    return (pos >= prompt_lens[:, None] - 1) & (pos < lengths[:, None] - 1)


def sft_batch(examples: Sequence[tuple[list[int], int]], pad_id: int, mask_prompt: bool,
              length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs (B, T - 1), targets (B, T - 1)) for next-token loss; targets IGNORE on padding, and on
    the prompt when mask_prompt (DeepSpeed-Chat scores the prompt too)."""
    ids, lengths = right_pad([e[0] for e in examples], pad_id, length)
    T = ids.shape[1]
    scored = response_mask(torch.tensor([e[1] for e in examples]) if mask_prompt else torch.ones_like(lengths),
                           lengths, T)
    targets = torch.where(scored, ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))
    return ids[:, :-1], targets


def pair_batch(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int,
               length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (2B, T), lengths (2B,)): the B chosen sequences, then the B rejected ones, one padding length."""
    seqs = [c for c, _ in pairs] + [r for _, r in pairs]
    return right_pad(seqs, pad_id, length)
