"""`polytrain chat`: the conversation rendered with the model's chat template, replies sampled with
the KV cache and stopped at the end of the turn."""

from __future__ import annotations

import io
import json

import pytest

from polytrain.cli import main
from polytrain.convert import import_hf
from polytrain.data.tokenizer import train_bpe
from polytrain.inference.chat import PLAIN, Chat, render, repl
from polytrain.inference.generate import generate
from polytrain.inference.load import load_run
from tests.models import hf_models

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def chat_run(tmp_path):
    tokenizer = train_bpe(["def main():\n    return 0\n" * 50, "hello there, how are you\n" * 50], 300)
    tokenizer.hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    hf = hf_models.gpt2(vocab_size=tokenizer.vocab_size + 3, n_positions=128)
    source = hf_models.save(hf, tmp_path / "hf")
    tokenizer.save(source / "tokenizer.json")
    (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return import_hf(source, tmp_path / "run")


def test_template_render_and_special_tokens(chat_run):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "and?"}]
    text = render(CHATML, messages)
    assert text == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
                    "<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n")
    assert render(PLAIN, messages[:1]) == "User: hi\nAssistant:"
    tok = load_run(chat_run).tokenizer
    assert tok.encode_chat("<|im_start|>user")[0] == tok.hf.token_to_id("<|im_start|>")
    assert tok.encode("<|im_start|>")[0] != tok.hf.token_to_id("<|im_start|>")  # plain text stays text


def test_reply_is_the_models_greedy_continuation_of_the_rendered_conversation(chat_run):
    run = load_run(chat_run)
    chat = Chat(run, chat_run, max_new_tokens=10, temperature=0)
    assert chat.template == CHATML
    first = chat.reply("hello there")
    ids = run.tokenizer.encode_chat(render(CHATML, [{"role": "user", "content": "hello there"}]))
    new = generate(run.model, [ids], 10, temperature=0, stop_tokens=chat.stops)[0]
    assert first == run.tokenizer.decode([t for t in new if t not in chat.stops]).strip()
    chat.reply("and then?")
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert run.tokenizer.hf.token_to_id("<|im_end|>") in chat.stops


def test_repl_and_cli(chat_run, monkeypatch, capsys):
    out = io.StringIO()
    chat = Chat(load_run(chat_run), chat_run, max_new_tokens=4, temperature=0)
    repl(chat, ["hello\n", "/reset\n", "again\n", "/exit\n", "never read\n"], out)
    assert out.getvalue().count("\n> ") == 3 and len(chat.messages) == 2  # reset forgot the first exchange
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", str(chat_run), "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("chat with the model")


def test_generate_command_on_encoder_decoder_and_encoder_runs(tmp_path, capsys):
    from polytrain.inference.generate import generate_seq2seq

    tokenizer = train_bpe(["translate this sentence\n" * 50], 300)
    for name, hf in (("t5", hf_models.t5(vocab_size=tokenizer.vocab_size)),
                     ("bert", hf_models.bert(vocab_size=tokenizer.vocab_size))):
        source = hf_models.save(hf, tmp_path / f"{name}-hf")
        tokenizer.save(source / "tokenizer.json")
        import_hf(source, tmp_path / name)
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "t5"), "--prompt", "translate", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    run = load_run(tmp_path / "t5")
    new = generate_seq2seq(run.model, [tokenizer.encode("translate")], 5, temperature=0,
                           stop_tokens={tokenizer.eot_id})[0]
    assert capsys.readouterr().out == tokenizer.decode(new) + "\n"
    assert main(["generate", str(tmp_path / "bert"), "--prompt", "x"]) == 2
    assert "bert is an encoder (masked LM)" in capsys.readouterr().err
