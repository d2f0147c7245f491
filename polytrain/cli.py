"""`polytrain` command line: train, rlhf, generate, chat, prepare, consolidate, convert, run.

    polytrain train [--config FILE.toml] [--deepspeed_config ds_config.json] [--section.key VALUE ...]
    polytrain rlhf [--config FILE.toml] [--section.key VALUE ...]   (SFT -> reward model -> PPO/GRPO)
    polytrain generate RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
    polytrain chat RUN_DIR [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
    polytrain prepare SOURCE OUT.bin [--vocab-size N] [--tokenizer bpe|PATH] [--val-fraction F]
    polytrain consolidate CHECKPOINT_DIR OUT [--dtype fp32|bf16|fp16] [--format safetensors|pt]
    polytrain convert HF_DIR OUT_DIR | polytrain convert --to hf RUN_OR_CHECKPOINT OUT_DIR [--dtype ...]
    polytrain run [--nproc N] SCRIPT [ARGS...]    (or -m MODULE [ARGS...]): a CUDA program, unchanged

Errors a user can fix print one line starting with "error:" and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from polytrain.errors import PolytrainError

USAGE = __doc__.split("\n\n")[1]


def _train(argv: list[str]) -> int:
    from polytrain.config import help_text
    from polytrain.train.__main__ import config_from_argv, run_worker

    if "-h" in argv or "--help" in argv:
        print("usage: polytrain train [--config FILE.toml] [--deepspeed_config ds_config.json] "
              "[--section.key VALUE ...]\n")
        print(help_text())
        return 0
    cfg = config_from_argv(argv)
    if cfg.parallel.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from polytrain.train.launch import launch_local_workers
        from polytrain.train.startup import plan_layout

        plan_layout(cfg, cfg.parallel.nproc)  # fail here, before starting workers
        return launch_local_workers(cfg.parallel.nproc, argv)
    return run_worker(argv, cfg)


def _rlhf(argv: list[str]) -> int:
    from polytrain.config import help_text
    from polytrain.rlhf.__main__ import run_worker
    from polytrain.train.__main__ import config_from_argv

    if "-h" in argv or "--help" in argv:
        print("usage: polytrain rlhf [--config FILE.toml] [--section.key VALUE ...]\n\n"
              "Runs step 1 (SFT), step 2 (reward model) and step 3 (PPO or GRPO) in runs/<name>/{sft,reward,ppo};\n"
              "finished steps are skipped, unfinished ones resume. Steps 1 and 2 read [train] and [parallel];\n"
              "the rlhf.<role>_* keys give each model its own layout.\n")
        print(help_text())
        return 0
    cfg = config_from_argv(argv)
    if cfg.parallel.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from polytrain.rlhf.run import check_rlhf
        from polytrain.train.launch import launch_local_workers

        check_rlhf(cfg, cfg.parallel.nproc)  # fail here, before starting workers
        return launch_local_workers(cfg.parallel.nproc, argv, module="polytrain.rlhf")
    return run_worker(argv, cfg)


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="polytrain generate", description="Sample text from a trained run.")
    parser.add_argument("run_dir", help="a run directory written by `polytrain train`")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, help="a step_<N> directory (default: the newest)")
    args = parser.parse_args(argv)

    from polytrain.inference.load import generate_text, load_run

    run = load_run(args.run_dir, args.checkpoint)
    print(generate_text(run, args.prompt, args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed))
    return 0


def _chat(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="polytrain chat",
                                     description="Talk to a decoder, with its chat template when it has one.")
    parser.add_argument("run_dir", help="a run directory (trained, made by `polytrain convert`, or an RLHF "
                                        "run: its final actor)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from pathlib import Path

    from polytrain.inference.chat import Chat, repl
    from polytrain.inference.load import load_run

    from polytrain.rlhf.plan import chat_dir

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.toml").is_file() and chat_dir(run_dir) is not None:
        run_dir = chat_dir(run_dir)  # an RLHF run: its final actor
    chat = Chat(load_run(run_dir), run_dir, args.max_new_tokens, args.temperature,
                args.top_k, args.top_p, args.seed)
    repl(chat)
    return 0


def _prepare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="polytrain prepare",
        description="Tokenize a corpus once into packed token files for data.source.")
    parser.add_argument("source", help="'stdlib', a .txt or .jsonl file (field text), or a directory of them")
    parser.add_argument("out", help="output path ending in .bin (also writes .val.bin, .json, .tokenizer.json)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of the trained BPE tokenizer")
    parser.add_argument("--tokenizer", default="bpe", help="'bpe' to train one, or a tokenizer.json path")
    parser.add_argument("--val-fraction", type=float, default=0.02)
    args = parser.parse_args(argv)

    from polytrain.data import prepare_to

    prepared = prepare_to(args.source, args.out, tokenizer=args.tokenizer,
                          vocab_size=args.vocab_size, val_fraction=args.val_fraction)
    print(f"wrote {prepared.train_path} ({prepared.n_train_tokens:,} tokens) and "
          f"{prepared.val_path} ({prepared.n_val_tokens:,} tokens)")
    return 0


def _consolidate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="polytrain consolidate",
        description="Write a checkpoint's model weights, from any layout, as one plain state dict file. "
                    "safetensors streams tensor by tensor (memory for about two of its largest tensors); "
                    "pt holds the whole model in memory once.")
    parser.add_argument("checkpoint", help="a runs/<name>/checkpoints/step_<N> directory")
    parser.add_argument("out", help="output file, or an existing directory to write model.<format> in")
    parser.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (floating tensors)")
    parser.add_argument("--format", default=None,
                        help="safetensors or pt (default: pt for .pt/.pth/.bin files, else safetensors)")
    args = parser.parse_args(argv)

    from polytrain.checkpoint.consolidate import consolidate

    out = consolidate(args.checkpoint, args.out, dtype=args.dtype, fmt=args.format)
    print(f"wrote {out} ({out.stat().st_size / 2**20:,.1f} MiB)")
    return 0


def _run(argv: list[str]) -> int:
    """Options up to the program's name are ours; everything from it on is the program's."""
    usage = ("usage: polytrain run [--nproc N] SCRIPT [ARGS...]\n"
             "       polytrain run [--nproc N] -m MODULE [ARGS...]\n\n"
             "Runs a program written for CUDA on the detected accelerator (POLYTRAIN_ACCELERATOR\n"
             "overrides), with CUDA's device module, devices and NCCL mapped onto it (docs/COMPAT.md).\n"
             "--nproc N starts N workers like torchrun; without it the program runs in this process.")
    nproc, i = None, 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        if argv[i] in ("-h", "--help"):
            print(usage)
            return 0
        option, _, value = argv[i].partition("=")
        if option != "--nproc":
            raise PolytrainError(f"polytrain run: unknown option {argv[i]} (only --nproc N comes "
                                 f"before the program; its own options come after it)")
        if not value:
            i += 1
            value = argv[i] if i < len(argv) else ""
        if not value.isdigit() or int(value) < 1:
            raise PolytrainError(f"polytrain run: --nproc needs a positive number, got {value!r}")
        nproc, i = int(value), i + 1
    program = argv[i:]
    if not program or program == ["-m"]:
        raise PolytrainError("polytrain run: name the program (SCRIPT [ARGS...] or -m MODULE [ARGS...])")
    if program[0] != "-m" and not os.path.isfile(program[0]):
        raise PolytrainError(f"no such script: {program[0]}")  # once, not once per worker

    from polytrain.compat.__main__ import main as run_here

    if nproc is None or "WORLD_SIZE" in os.environ:  # already one worker of a torchrun job
        return run_here(program)
    from polytrain.train.launch import launch_local_workers

    return launch_local_workers(nproc, program, module="polytrain.compat")


def _convert(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="polytrain convert",
        description="Hugging Face model directory -> polytrain run directory (default), or back with --to hf.")
    parser.add_argument("source", help="an HF directory (config.json + safetensors/.bin), or with --to hf "
                                       "a run directory or one of its checkpoints/step_<N>")
    parser.add_argument("out", help="directory to write (a new run directory, or the HF directory)")
    parser.add_argument("--to", choices=("polytrain", "hf"), default="polytrain")
    parser.add_argument("--dtype", default=None, help="--to hf: fp32, bf16 or fp16 (default: as stored)")
    args = parser.parse_args(argv)

    from polytrain.convert import export_hf, import_hf

    if args.to == "hf":
        out = export_hf(args.source, args.out, dtype=args.dtype)
        print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}")
    else:
        out = import_hf(args.source, args.out)
        print(f"wrote run directory {out}: polytrain generate {out} --prompt ...; "
              f"polytrain train --config {out / 'config.toml'}")
    return 0


COMMANDS = {"train": _train, "rlhf": _rlhf, "generate": _generate, "prepare": _prepare, "consolidate": _consolidate,
            "convert": _convert, "chat": _chat, "run": _run}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage:\n" + USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command '{command}'; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except PolytrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
