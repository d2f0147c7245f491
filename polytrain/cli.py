"""`polytrain` command line: train, generate, chat, eval, prepare, consolidate, convert, run.

    polytrain train [--config FILE.toml] [--deepspeed_config ds_config.json] [--section.key VALUE ...]
    polytrain generate RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--parallel.cp N]
    polytrain chat RUN_DIR [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--parallel.cp N]
    polytrain eval needle RUN_DIR [--lengths 1k,4k,16k] [--depths 0,25,50,75,100] [--repeats N] [--out DIR] [--parallel.cp N]
    polytrain prepare SOURCE OUT.bin [--vocab-size N] [--tokenizer bpe|PATH] [--val-fraction F]
    polytrain consolidate CHECKPOINT_DIR OUT [--dtype fp32|bf16|fp16] [--format safetensors|pt]
    polytrain convert HF_DIR OUT_DIR | polytrain convert --to hf RUN_OR_CHECKPOINT OUT_DIR [--dtype ...]
    polytrain run [--nproc N] SCRIPT [ARGS...]    (or -m MODULE [ARGS...]): a CUDA program, unchanged

Errors a user can fix print one line starting with "error:" and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
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


def _cp_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parallel.cp", dest="cp", type=int, default=1,
                        help="split the prompt's KV cache (and prefill) over N local workers")
    parser.add_argument("--parallel.cp_mode", dest="cp_mode", default="ring", help="ring, ulysses or hybrid")
    parser.add_argument("--parallel.cp_ulysses", dest="cp_ulysses", type=int, default=1,
                        help="hybrid: Ulysses degree inside each ring rank")


def _launch_cp(args, command: list[str], argv: list[str]) -> int | None:
    """With --parallel.cp N > 1 outside a job: run this command as N workers (their exit code); else None."""
    if args.cp <= 1 or "WORLD_SIZE" in os.environ:
        return None
    from pathlib import Path

    from polytrain.config import load_config
    from polytrain.distributed.context_parallel.checks import check_context_parallel
    from polytrain.train.launch import launch_local_workers

    config = Path(args.run_dir) / "config.toml"
    if config.is_file():  # the degrees against the run's heads, here, before starting workers
        m = load_config(config).model
        check_context_parallel(args.cp, args.cp_mode, args.cp_ulysses, 4 * args.cp**2, m.n_heads, m.n_kv_heads)
    return launch_local_workers(args.cp, [*command, *argv], module="polytrain.cli")


@contextlib.contextmanager
def _cp_sampler(args, run):
    """(the sampler for `run`, whether this process prints): cp_generate_fn's on a cp group, else the
    plain one. A worker leaves the group together with the others (no rank exits mid-collective)."""
    if args.cp <= 1:
        from polytrain.inference.generate import generate

        yield generate, True
        return
    import torch.distributed as dist

    from polytrain.inference.cp_generate import cp_generate_fn, join_context_parallel

    cp = join_context_parallel(run.model, args.cp, args.cp_mode, args.cp_ulysses)
    try:
        yield cp_generate_fn(cp), dist.get_rank() == 0
    finally:
        dist.barrier()
        dist.destroy_process_group()


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
    _cp_options(parser)
    args = parser.parse_args(argv)
    if (code := _launch_cp(args, ["generate"], argv)) is not None:
        return code

    from polytrain.inference.load import generate_text, load_run

    run = load_run(args.run_dir, args.checkpoint)
    with _cp_sampler(args, run) as (sampler, prints):
        text = generate_text(run, args.prompt, args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, generate_fn=sampler)
    if prints:
        print(text)
    return 0


def _chat(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="polytrain chat",
                                     description="Talk to a decoder, with its chat template when it has one.")
    parser.add_argument("run_dir", help="a run directory (trained, or made by `polytrain convert`)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    _cp_options(parser)
    args = parser.parse_args(argv)
    if (code := _launch_cp(args, ["chat"], argv)) is not None:
        return code

    import io
    from pathlib import Path

    from polytrain.inference.chat import Chat, repl
    from polytrain.inference.load import load_run

    run = load_run(args.run_dir)
    with _cp_sampler(args, run) as (sampler, prints):
        chat = Chat(run, Path(args.run_dir), args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                    args.seed, generate_fn=sampler)
        if args.cp <= 1:
            repl(chat)
            return 0
        from polytrain.inference.cp_generate import shared_lines

        # Rank 0 reads the turns and hands each to every worker; all of them reply (identically).
        repl(chat, shared_lines(sys.stdin if prints else None), sys.stdout if prints else io.StringIO())
    return 0


def _eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="polytrain eval", description="Evaluate a trained run.")
    tasks = parser.add_subparsers(dest="task", required=True)
    needle = tasks.add_parser("needle", help="needle-in-a-haystack retrieval over lengths x depths; "
                                             "writes needle.json and needle.png")
    needle.add_argument("run_dir", help="a run directory (trained, or made by `polytrain convert`)")
    needle.add_argument("--lengths", default="1k,2k,4k", help="context lengths in tokens, k = 1024")
    needle.add_argument("--depths", default="0,25,50,75,100", help="needle depths, percent of the context")
    needle.add_argument("--repeats", type=int, default=2, help="prompts per cell (different keys and haystacks)")
    needle.add_argument("--needles", type=int, default=1, help="needles per prompt (> 1: multi-needle retrieval)")
    needle.add_argument("--haystack", default="stdlib", help="corpus of the filler text (as data.source)")
    needle.add_argument("--seed", type=int, default=0)
    needle.add_argument("--checkpoint", default=None, help="a step_<N> directory (default: the newest)")
    needle.add_argument("--out", default=None, help="directory for needle.json / needle.png (default: RUN_DIR)")
    _cp_options(needle)
    args = parser.parse_args(argv)
    if (code := _launch_cp(args, ["eval"], argv)) is not None:
        return code

    from polytrain.inference.load import load_run
    from polytrain.inference.needle import evaluate_needle, parse_depths, parse_lengths, write_needle

    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    run = load_run(args.run_dir, args.checkpoint)
    with _cp_sampler(args, run) as (sampler, prints):
        result = evaluate_needle(run.model, run.tokenizer, lengths, depths, repeats=args.repeats,
                                 needles=args.needles, seed=args.seed, source=args.haystack, generate_fn=sampler)
    result["checkpoint"] = str(run.checkpoint)
    if prints:
        paths = write_needle(result, args.out or args.run_dir, title=run.checkpoint.parent.parent.name)
        print(f"needle retrieval overall {result['overall']:.1f} / 100; wrote {paths[0]} and {paths[1]}")
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


COMMANDS = {"train": _train, "generate": _generate, "prepare": _prepare, "consolidate": _consolidate,
            "convert": _convert, "chat": _chat, "run": _run, "eval": _eval}


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
