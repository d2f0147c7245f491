"""Write the test assets torchtitan's debug configurations read, made here instead of downloaded:

    DIR/tests/assets/tokenizer/   tokenizer.json + tokenizer_config.json (a byte-level BPE of
                                  2,000 tokens, within the debug model's 2,048-word vocabulary)
    DIR/tests/assets/c4_test/     data.json: C4's record format, one {"text", "timestamp", "url"}
                                  object per line, which `datasets.load_dataset(DIR)` reads

The text is the source of Python's standard library (json, argparse, textwrap, ...), so the
assets are the same on every machine. Usage: python torchtitan_assets.py DIR
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

MODULES = ("json.decoder", "json.encoder", "argparse", "textwrap", "string", "shlex", "fnmatch",
           "difflib", "pprint", "calendar")
VOCAB = 2000


def documents() -> list[str]:
    """Paragraphs of standard-library source, one document each."""
    import importlib

    docs = []
    for name in MODULES:
        source = inspect.getsource(importlib.import_module(name))
        docs += [part.strip() for part in source.split("\n\n") if len(part.strip()) > 200]
    return docs


def write_tokenizer(folder: Path, docs: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": special[0], "eos_token": special[1], "add_bos_token": True,
         "add_eos_token": False, "model_max_length": 131072}))


def write_c4_test(folder: Path, docs: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "data.json", "w") as f:
        for i, text in enumerate(docs):
            record = {"text": text, "timestamp": "2019-04-25T12:57:54Z",
                      "url": f"https://docs.python.org/3/library/{i}.html"}
            f.write(json.dumps(record) + "\n")


def main(root: Path) -> None:
    docs = documents()
    write_tokenizer(root / "tests" / "assets" / "tokenizer", docs)
    write_c4_test(root / "tests" / "assets" / "c4_test", docs)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
