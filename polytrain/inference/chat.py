"""`polytrain chat RUN_DIR`: a conversation with a decoder, one reply per line typed.

The prompt is the whole conversation rendered with the chat template of the model's
tokenizer_config.json (kept under <run>/hf/ by `polytrain convert`, or beside
tokenizer.json), the Jinja template transformers' apply_chat_template uses; without
one, a plain "User: ... / Assistant:" transcript. Each reply is sampled with the KV
cache until an end-of-text or end-of-turn token; when the conversation outgrows the
model's context, the oldest turns are dropped.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

import torch

from polytrain.errors import ConfigError
from polytrain.inference.generate import generate
from polytrain.inference.load import LoadedRun, stop_tokens
from polytrain.models import ARCHITECTURES

PLAIN = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}Assistant:{% endif %}")


def chat_template(run_dir: Path) -> str | None:
    """The chat_template of the run's tokenizer_config.json (hf/ or beside tokenizer.json), if any."""
    for path in (run_dir / "hf" / "tokenizer_config.json", run_dir / "tokenizer_config.json"):
        if path.is_file():
            template = json.loads(path.read_text()).get("chat_template")
            if isinstance(template, list):  # several named templates: take the default one
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
            if template:
                return template
    return None


def render(template: str, messages: list[dict[str, str]], bos: str = "", eos: str = "") -> str:
    """The conversation as text, ready for the assistant's turn (a sandboxed Jinja render)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                bos_token=bos, eos_token=eos)
    except TemplateError as e:
        raise ConfigError(f"the chat template failed: {e}") from None


class Chat:
    """The conversation so far and how to continue it."""

    def __init__(self, run: LoadedRun, run_dir: Path, max_new_tokens: int = 200, temperature: float = 0.7,
                 top_k: int | None = 40, top_p: float | None = None, seed: int = 0, generate_fn=generate):
        """generate_fn: the sampler, with inference.generate's contract (cp_generate_fn's over a cp group)."""
        self.generate_fn = generate_fn
        if ARCHITECTURES[run.cfg.model.arch].kind != "decoder":
            raise ConfigError(f"polytrain chat needs a decoder (llama, gpt2, internlm2), not {run.cfg.model.arch}")
        self.run, self.template = run, chat_template(run_dir) or PLAIN
        self.messages: list[dict[str, str]] = []
        self.max_new_tokens, self.sampling = max_new_tokens, dict(temperature=temperature, top_k=top_k, top_p=top_p)
        device = next(run.model.parameters()).device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.stops = stop_tokens(run.tokenizer)

    def prompt_ids(self) -> list[int]:
        tok = self.run.tokenizer
        eos = tok.hf.id_to_token(tok.eot_id)
        return tok.encode_chat(render(self.template, self.messages, eos=eos))

    def reply(self, text: str) -> str:
        """Add the user's turn, sample the assistant's, remember it and return it."""
        self.messages.append({"role": "user", "content": text})
        ids = self.prompt_ids()
        context = self.run.cfg.model.max_seq_len
        while len(ids) + 1 > context and len(self.messages) > 1:  # forget the oldest exchange
            self.messages = self.messages[2:] if len(self.messages) > 2 else self.messages[1:]
            ids = self.prompt_ids()
        if len(ids) >= context:
            raise ConfigError(f"the message is {len(ids)} tokens; this model's context is {context}")
        new = self.generate_fn(self.run.model, [ids], min(self.max_new_tokens, context - len(ids)),
                       stop_tokens=self.stops, generator=self.generator, **self.sampling)[0]
        if new and new[-1] in self.stops:
            new = new[:-1]
        answer = self.run.tokenizer.decode(new).strip()
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def repl(chat: Chat, lines: Iterable[str] | None = None, out: TextIO | None = None) -> None:
    """Read user turns line by line (default: stdin, until its end or /exit) and print each reply."""
    lines, out = lines if lines is not None else sys.stdin, out or sys.stdout
    out.write("chat with the model; /exit or end of input quits, /reset forgets the conversation\n> ")
    out.flush()
    for line in lines:
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            chat.messages = []
        elif text:
            out.write(chat.reply(text) + "\n")
        out.write("> ")
        out.flush()
    out.write("\n")
