"""`polytrain` command line: train, rlhf, plan, generate, chat, eval, prepare, consolidate, convert, run.

    polytrain train [--config FILE.toml] [--deepspeed_config ds_config.json] [--section.key VALUE ...]
    polytrain rlhf [--config FILE.toml] [--section.key VALUE ...]   (SFT -> reward model -> PPO/GRPO)
    polytrain generate RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--parallel.cp N]
    polytrain chat RUN_DIR [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--parallel.cp N]
    polytrain eval needle RUN_DIR [--lengths 1k,4k,16k] [--depths 0,25,50,75,100] [--repeats N] [--out DIR] [--parallel.cp N]
    polytrain prepare SOURCE OUT.bin [--vocab-size N] [--tokenizer bpe|PATH] [--val-fraction F] [--text-field F]
    polytrain consolidate CHECKPOINT_DIR OUT [--dtype fp32|bf16|fp16] [--format safetensors|pt]
    polytrain convert HF_DIR OUT_DIR | polytrain convert --to hf RUN_OR_CHECKPOINT OUT_DIR [--dtype ...]
    polytrain convert --to peft RUN_OR_CHECKPOINT OUT_DIR | polytrain convert ADAPTER_DIR OUT_DIR --base RUN
    polytrain run [--nproc N] SCRIPT [ARGS...]    (or -m MODULE [ARGS...]): a CUDA program, unchanged
    polytrain plan --devices N [--device H100|cpu|...] [--nodes K] [--config FILE] [--json] [--section.key VALUE ...]

Errors a user can fix print one line starting with "error:" and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path

from polytrain.errors import PolytrainError

USAGE = __doc__.split("\n\n")[1]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one `error:` line (a PolytrainError), like every other."""

    def error(self, message: str):
        raise PolytrainError(f"{self.prog}: {message} (see {self.prog} --help)")


def _whole(low: int):
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {low}")
        return value
    return parse


def _number(low: float, high: float, open_low: bool = False, open_high: bool = False):
    """An argparse type: a float in the interval [low, high], with either end open."""
    interval = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high or high == math.inf else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value > low if open_low else value >= low  # NaN is neither
        below = value < high if open_high else value <= high
        if not (above and below):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number in {interval}")
        return value
    return parse


def _add_sampling(parser: argparse.ArgumentParser, max_new_tokens: int, temperature: float,
                  top_k: int | None) -> None:
    """The sampling options of generate and chat, checked as they are parsed."""
    parser.add_argument("--max-new-tokens", type=_whole(0), default=max_new_tokens)
    parser.add_argument("--temperature", type=_number(0, math.inf, open_high=True), default=temperature,
                        help="0 = greedy")
    parser.add_argument("--top-k", type=_whole(1), default=top_k,
                        help="sample among the k most likely tokens" + ("" if top_k else " (default: all)"))
    parser.add_argument("--top-p", type=_number(0, 1, open_low=True), default=None,
                        help="sample among the most likely tokens holding this share of the probability")
    parser.add_argument("--seed", type=int, default=0)


def _train(argv: list[str]) -> int:
    from polytrain.config import help_text
    from polytrain.train.__main__ import config_from_argv, run_worker
    from polytrain.train.loggers import require_loggers

    if "-h" in argv or "--help" in argv:
        print("usage: polytrain train [--config FILE.toml] [--deepspeed_config ds_config.json] "
              "[--section.key VALUE ...]\n")
        print(help_text())
        return 0
    cfg = config_from_argv(argv)
    require_loggers(cfg)  # once, before any worker starts
    if cfg.parallel.nproc_min and "WORLD_SIZE" not in os.environ:
        from polytrain.backend import get_accelerator
        from polytrain.train.elastic_launch import ElasticLauncher

        p = cfg.parallel
        _plan_elastic(cfg, p.nproc_min, p.nproc, nodes=1)  # a layout for every size the job may run at
        return ElasticLauncher(p.nproc_min, p.nproc, argv, cfg.run_dir, p.max_restarts,
                               get_accelerator().visible_devices_env, p.nproc_start).run()
    if cfg.parallel.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from polytrain.train.launch import launch_local_workers
        from polytrain.train.startup import plan_layout

        plan_layout(cfg, cfg.parallel.nproc)  # fail here, before starting workers
        return launch_local_workers(cfg.parallel.nproc, argv)
    return run_worker(argv, cfg)


def _plan_elastic(cfg, low: int, high: int, nodes: int, cluster=None) -> dict:
    """Plan a layout keeping the global batch for every world size in [low, high] and write them to the
    run directory, where the workers read theirs (train/elastic.py); ConfigError if a size has none."""
    from polytrain.plan.elastic import elastic_layouts, write_layouts

    if cluster is None:
        from polytrain.backend import get_accelerator
        from polytrain.plan.devices import Cluster, device_for_accelerator

        cluster = Cluster(device_for_accelerator(get_accelerator()), high * nodes, nodes)
    layouts = elastic_layouts(cfg, low, high, cluster)
    write_layouts(cfg, layouts)
    return layouts


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
    parser = _Parser(prog="polytrain generate", description="Sample text from a trained run.")
    parser.add_argument("run_dir", help="a run directory written by `polytrain train`")
    parser.add_argument("--prompt", required=True, help="text to continue; empty = a new document")
    _add_sampling(parser, max_new_tokens=100, temperature=0.8, top_k=None)
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
    parser = _Parser(prog="polytrain chat", description="Talk to a decoder, with its chat template when it has one.")
    parser.add_argument("run_dir", help="a run directory (trained, made by `polytrain convert`, or an RLHF "
                                        "run: its final actor)")
    _add_sampling(parser, max_new_tokens=200, temperature=0.7, top_k=40)
    _cp_options(parser)
    args = parser.parse_args(argv)
    if (code := _launch_cp(args, ["chat"], argv)) is not None:
        return code

    import io

    from polytrain.inference.chat import Chat, repl
    from polytrain.inference.load import load_run
    from polytrain.rlhf.plan import chat_dir

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.toml").is_file() and chat_dir(run_dir) is not None:
        run_dir = chat_dir(run_dir)  # an RLHF run: its final actor
    run = load_run(run_dir)
    with _cp_sampler(args, run) as (sampler, prints):
        chat = Chat(run, run_dir, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                    args.seed, generate_fn=sampler)
        if args.cp <= 1:
            repl(chat)
            return 0
        from polytrain.inference.cp_generate import shared_lines

        # Rank 0 reads the turns and hands each to every worker; all of them reply (identically).
        repl(chat, shared_lines(sys.stdin if prints else None), sys.stdout if prints else io.StringIO())
    return 0


def _eval(argv: list[str]) -> int:
    parser = _Parser(prog="polytrain eval", description="Evaluate a trained run.")
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
    parser = _Parser(
        prog="polytrain prepare",
        description="Tokenize a corpus once into packed token files for data.source.")
    parser.add_argument("source", help="'stdlib', a .txt, .jsonl, .parquet or .arrow file, a directory of them, "
                                       "or hf:NAME[:CONFIG][:SPLIT] (Hugging Face Datasets)")
    parser.add_argument("out", help="output path ending in .bin (also writes .val.bin, .json, .tokenizer.json)")
    parser.add_argument("--vocab-size", type=_whole(257), default=4096,
                        help="vocabulary of the trained BPE tokenizer (at least 256 bytes + <|endoftext|>)")
    parser.add_argument("--tokenizer", default="bpe", help="'bpe' to train one, or a tokenizer.json path")
    parser.add_argument("--text-field", default="text", help="the .jsonl field / .parquet, .arrow, hf: column of the text")
    parser.add_argument("--val-fraction", type=_number(0, 1, open_low=True, open_high=True), default=0.02,
                        help="share of documents held out for validation")
    args = parser.parse_args(argv)

    from polytrain.data import prepare_to

    prepared = prepare_to(args.source, args.out, tokenizer=args.tokenizer,
                          vocab_size=args.vocab_size, val_fraction=args.val_fraction, text_field=args.text_field)
    print(f"wrote {prepared.train_path} ({prepared.n_train_tokens:,} tokens) and "
          f"{prepared.val_path} ({prepared.n_val_tokens:,} tokens)")
    return 0


def _consolidate(argv: list[str]) -> int:
    parser = _Parser(
        prog="polytrain consolidate",
        description="Write a checkpoint's model weights, from any layout, as one plain state dict file. "
                    "safetensors streams tensor by tensor (memory for about two of its largest tensors); "
                    "pt holds the whole model in memory once.")
    parser.add_argument("checkpoint", help="a runs/<name>/checkpoints/step_<N> directory, or a run directory (its newest)")
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
        from polytrain.train.worker_exit import run_and_exit

        # Ends as a launched worker does: left to interpreter teardown, the program's gloo or
        # compile-pool threads can abort a finished run ("terminate called", SIGABRT).
        run_and_exit(lambda: run_here(program))
    from polytrain.train.launch import launch_local_workers

    return launch_local_workers(nproc, program, module="polytrain.compat")


def _convert(argv: list[str]) -> int:
    parser = _Parser(
        prog="polytrain convert",
        description="Hugging Face model directory -> polytrain run directory (default), or back with --to hf; "
                    "LoRA adapters -> a PEFT adapter directory with --to peft, or a PEFT adapter directory "
                    "(adapter_config.json) -> a run of adapters on --base.")
    parser.add_argument("source", help="an HF directory (config.json + safetensors/.bin) or a PEFT adapter "
                                       "directory, or with --to hf / peft a run directory or one of its "
                                       "checkpoints/step_<N>")
    parser.add_argument("out", help="directory to write (a new run directory, the HF or the PEFT directory)")
    parser.add_argument("--to", choices=("polytrain", "hf", "peft"), default="polytrain")
    parser.add_argument("--dtype", default=None, help="--to hf: fp32, bf16 or fp16 (default: as stored)")
    parser.add_argument("--base", default=None, help="importing a PEFT adapter: the polytrain run or checkpoint "
                                                     "of the model it adapts (polytrain convert HF_DIR of it)")
    args = parser.parse_args(argv)

    from polytrain.convert import export_hf, import_hf
    from polytrain.convert.peft import CONFIG_FILE, export_peft, import_peft

    if args.to == "hf":
        out = export_hf(args.source, args.out, dtype=args.dtype)
        print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}")
    elif args.to == "peft":
        out = export_peft(args.source, args.out)
        print(f"wrote {out / CONFIG_FILE}: PeftModel.from_pretrained(<the HF export of its base>, '{out}')")
    elif (Path(args.source) / CONFIG_FILE).is_file():
        if args.base is None:
            raise PolytrainError(f"{args.source} is a PEFT adapter: name the polytrain run or checkpoint of "
                                 "its base model with --base (polytrain convert HF_DIR makes one)")
        out = import_peft(args.source, args.out, args.base)
        print(f"wrote run directory {out}: adapters on {args.base}; polytrain generate {out} --prompt ...")
    else:
        out = import_hf(args.source, args.out)
        print(f"wrote run directory {out}: polytrain generate {out} --prompt ...; "
              f"polytrain train --config {out / 'config.toml'}")
    return 0


def _plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="polytrain plan",
        description="Rank the parallel layouts of a cluster for a config: peak memory per rank and step "
                    "time of each, best first. Layout keys the config sets (e.g. --parallel.tp 2) stay fixed.",
        epilog="Any --section.key VALUE after the options overrides the config, as for polytrain train.")
    parser.add_argument("--config", help="a TOML config (default: the built-in defaults)")
    parser.add_argument("--devices", type=int, required=True, help="number of devices (the world size)")
    parser.add_argument("--device", default="cpu", help="H100, H200, A100, A100-40GB, MI300X, or cpu "
                                                        "(this machine, measured); default cpu")
    parser.add_argument("--device-memory", help="memory per device, e.g. 80GB (binary units)")
    parser.add_argument("--device-flops", help="peak matmul FLOP/s per device, e.g. 989T")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the devices are spread over")
    parser.add_argument("--link", help="bandwidth per device: 'nvlink', '450GB/s' (in a node) or "
                                       "'intra=450GB/s,inter=400Gb/s'")
    parser.add_argument("--headroom", type=float, default=0.05, help="share of memory kept free (default 0.05)")
    parser.add_argument("--top", type=int, default=10, help="layouts to show (0 = all that fit)")
    parser.add_argument("--allow-cp", action="store_true",
                        help="also propose context parallelism (planned only when the config sets parallel.cp)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, best first")
    parser.add_argument("--elastic", metavar="MIN:MAX",
                        help="plan a layout for every world size MIN..MAX (the config's global batch kept) and "
                             "write them to <run dir>/elastic_layouts.json for a torchrun --nnodes MIN:MAX job")
    args, overrides = parser.parse_known_args(argv)

    from polytrain.config import load_config
    from polytrain.plan import Cluster, device_spec, model_shape, plan, with_overrides
    from polytrain.plan.report import format_json, format_table

    cfg = load_config(args.config, overrides)
    cluster = with_overrides(Cluster(device_spec(args.device), args.devices, args.nodes),
                             memory=args.device_memory, link=args.link, flops=args.device_flops)
    if args.elastic:
        low, _, high = args.elastic.partition(":")
        if not (low.isdigit() and high.isdigit()):
            raise PolytrainError(f"--elastic {args.elastic!r}: write MIN:MAX world sizes, e.g. 8:64")
        layouts = _plan_elastic(cfg, int(low), int(high), args.nodes, cluster)
        for world, keys in layouts.items():
            print(f"{world:>5} ranks: " + " ".join(f"--{k} {str(v).lower() if isinstance(v, bool) else v}"
                                                   for k, v in keys.items()))
        print(f"wrote {cfg.run_dir / 'elastic_layouts.json'}")
        return 0
    estimates = plan(cfg, cluster, headroom=args.headroom, allow_cp=args.allow_cp)
    if not estimates:
        raise PolytrainError(f"no layout of {args.devices} devices passes start-up's checks for this config "
                             f"(the layout keys it fixes, the global batch, the model's head counts)")
    if args.json:
        print(format_json(estimates, args.top))
    else:
        print(format_table(cfg, cluster, estimates, args.top, model_shape(cfg).num_params, args.config))
    return 0


COMMANDS = {"train": _train, "rlhf": _rlhf, "plan": _plan, "generate": _generate, "chat": _chat, "eval": _eval,
            "prepare": _prepare, "consolidate": _consolidate, "convert": _convert, "run": _run}


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
