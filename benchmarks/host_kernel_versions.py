"""The host kernel's few-row products at two versions of its source, paired in one process.

    python benchmarks/host_kernel_versions.py --base HEAD~1                  # bf16, rows 1,2,4,8,16
    python benchmarks/host_kernel_versions.py --base f06995f~1 --dtype fp32
    python benchmarks/host_kernel_versions.py --base HEAD --rounds 1 --megabytes 4 --rows 1,3   # a check it runs

A kernel change is worth 10-30% where the machine's own speed moves 10-20% between processes,
so two builds are compared inside one: polytrain/backend/host_matmul.cpp and its headers as
they are in the working tree and as they were at --base (git), each built with the flags
`host_matmul.available()` uses into an operator namespace of its own. Over llama 125m's weight
shapes (enough distinct random weights of each to make --megabytes, none hot in the cache) the
two versions alternate, the first of each round alternating too. Reported per row count and
shape: the weight bytes each reads per second (median over rounds) and the median and spread of
the per-round ratio working tree / base, with the largest difference between their outputs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from polytrain.backend import host_matmul
from polytrain.backend.flops import cpu_model

SHAPES = ((32000, 768), (2048, 768), (768, 2048), (768, 768), (256, 768))  # llama 125m: out, in
REPO = Path(__file__).resolve().parent.parent
SOURCE_FILES = [f.relative_to(REPO) for f in (host_matmul.SOURCES[0], *host_matmul.HEADERS)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD~1", help="git revision of the kernel to compare against")
    p.add_argument("--rows", default="1,2,4,8,16", help="comma list of row counts (decoding's batch)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--megabytes", type=int, default=200, help="of distinct weights per shape")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    return p.parse_args()


def build(name: str, texts: dict[Path, str], directory: Path):
    """Build host_matmul.cpp (texts: path -> source) with its operators under `name`; returns
    torch.ops.<name>.thin_linear."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True)
    for path, text in texts.items():
        if path.suffix == ".cpp":  # the operators into a namespace of their own
            text = text.replace("TORCH_LIBRARY_FRAGMENT(polytrain,", f"TORCH_LIBRARY_FRAGMENT({name},")
            text = text.replace("TORCH_LIBRARY_IMPL(polytrain,", f"TORCH_LIBRARY_IMPL({name},")
            assert f"({name}," in text, "host_matmul.cpp no longer registers its operators as this script expects"
        (directory / path.name).write_text(text)
    cpp_extension.load(name=name, sources=[str(directory / SOURCE_FILES[0].name)], build_directory=str(directory),
                       extra_cflags=host_matmul.compile_flags(), is_python_module=False, verbose=False)
    return getattr(torch.ops, name).thin_linear


def sources_at(revision: str) -> dict[Path, str]:
    return {path: subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, check=True, capture_output=True,
                                 text=True).stdout for path in SOURCE_FILES}


def main() -> None:
    args = parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    base_commit = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=REPO, check=True,
                                 capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"working tree": build("polytrain_tree", {p: (REPO / p).read_text() for p in SOURCE_FILES},
                                         Path(tmp) / "tree"),
                   base_commit: build("polytrain_base", sources_at(args.base), Path(tmp) / "base")}
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    print(f"\n{datetime.date.today()}, cpu: {cpu_model()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}, {args.dtype}, load average {load:.1f} at start; working tree "
          f"against {base_commit}, {args.megabytes} MiB of weights per shape, {args.rounds} rounds\n")
    print(f"| rows | weight (out, in) | {base_commit} GB/s | working tree GB/s | tree / base (spread) | "
          f"largest difference |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for shape in SHAPES:
        count = max(1, args.megabytes * 2**20 // (shape[0] * shape[1] * dtype.itemsize))
        weights = [torch.randn(shape).to(dtype) for _ in range(count)]
        read = sum(w.numel() * w.element_size() for w in weights)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, shape[1]).to(dtype)
            outputs = {name: kernel(x, weights[0], None) for name, kernel in kernels.items()}
            scale = outputs["working tree"].abs().max().clamp_min(1e-30)
            difference = ((outputs["working tree"].float() - outputs[base_commit].float()).abs().max() / scale).item()
            for kernel in kernels.values():  # once untimed: first-touch and the threads' start-up
                for w in weights:
                    kernel(x, w, None)
            seconds = {name: [] for name in kernels}
            for round_ in range(args.rounds):
                order = list(kernels) if round_ % 2 == 0 else list(reversed(kernels))
                for name in order:
                    start = time.perf_counter()
                    for w in weights:
                        kernels[name](x, w, None)
                    seconds[name].append(time.perf_counter() - start)
            base, tree = seconds[base_commit], seconds["working tree"]
            ratios = [b / t for b, t in zip(base, tree)]
            print(f"| {rows} | {shape} | {read / statistics.median(base) / 1e9:.1f} | "
                  f"{read / statistics.median(tree) / 1e9:.1f} | {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) | {difference:.1e} |", flush=True)
        del weights


if __name__ == "__main__":
    main()
