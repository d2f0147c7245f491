"""LoRA adapters <-> a Hugging Face PEFT adapter directory.

    polytrain convert --to peft RUN_OR_CHECKPOINT OUT_DIR             # adapters -> PEFT
    polytrain convert ADAPTER_DIR OUT_DIR --base RUN_OR_CHECKPOINT    # PEFT -> a run of adapters on a base

OUT_DIR of the export holds adapter_config.json and adapter_model.safetensors, which
`PeftModel.from_pretrained(model, OUT_DIR)` loads on top of the Hugging Face export of the
base (`polytrain convert --to hf` of the checkpoint the adapters name as their base, or the
HF directory that base was imported from). PEFT keys an adapter by the HF module it adapts:

    base_model.model.<HF module>.lora_A.weight   (r, in)
    base_model.model.<HF module>.lora_B.weight   (out, r)      update: lora_alpha / r * B A

Each architecture's hf.py names its block Linear layers' HF modules (LINEAR_MODULES, under
BLOCK_PREFIX). Several polytrain layers may be one HF module, stacked along its outputs
(GPT-2's c_attn = wq, wk, wv): PEFT has one adapter there, so the export stacks the k adapted
members' A (k r, in) and sets B block-diagonal (out, k r), with rank k r and alpha k alpha
(rank_pattern / alpha_pattern) so the scale stays alpha / r; the import splits a block-diagonal
B of all members back into their own adapters, and otherwise gives each member the shared A
and its rows of B. Imported ranks that differ are zero-padded to the largest, B rescaled to
the one scale: the same update, within float rounding of the rescale (none when the scales agree).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from polytrain.checkpoint import RunDir
from polytrain.config import Config, LoRAConfig, load_config, to_toml
from polytrain.errors import CheckpointError, ConfigError
from polytrain.io.hf_files import write_safetensors
from polytrain.models import ARCHITECTURES

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def _hf_tables(cfg: Config):
    hf = ARCHITECTURES[cfg.model.arch].hf()
    if not hasattr(hf, "LINEAR_MODULES"):
        have = [a for a, arch in ARCHITECTURES.items() if hasattr(arch.hf(), "LINEAR_MODULES")]
        raise ConfigError(f"PEFT adapters convert for {', '.join(have)}, not {cfg.model.arch}")
    return hf


def _modules(cfg: Config) -> dict[str, dict[str, tuple[int, int]]]:
    """HF module name -> {polytrain Linear name: (first output row, rows)}, members in stacking order."""
    from polytrain.lora.adapter import block_linears

    hf = _hf_tables(cfg)
    with torch.device("meta"):
        linears = block_linears(ARCHITECTURES[cfg.model.arch].build(cfg.model))
    modules: dict[str, dict[str, tuple[int, int]]] = {}
    for i in range(cfg.model.n_layers):
        for ours, theirs in hf.LINEAR_MODULES.items():
            members = modules.setdefault(hf.BLOCK_PREFIX.format(i=i) + theirs, {})
            name = f"layers.{i}.{ours}"
            start = sum(rows for _, rows in members.values())
            members[name] = (start, linears[name].out_features)
    return modules


def export_peft(source: str | Path, out_dir: str | Path) -> Path:
    """Write the LoRA adapters of a run (newest checkpoint) or a checkpoint as a PEFT adapter directory."""
    from polytrain.checkpoint.consolidate import read_model_tensors
    from polytrain.checkpoint.trainer_state import read_state
    from polytrain.convert import resolve_checkpoint

    checkpoint, run_dir = resolve_checkpoint(source)
    state = read_state(checkpoint)
    if state.lora is None:
        raise ConfigError(f"{checkpoint} holds no LoRA adapters (lora.rank was 0); export it with --to hf")
    if not state.adapters_only:
        raise ConfigError(f"the base weights of {checkpoint} were trained too (lora.only_optimize = false), so "
                          "adapters alone cannot reproduce it; export the merged model with --to hf")
    cfg = load_config(RunDir(run_dir).config)
    hf = _hf_tables(cfg)
    tensors = read_model_tensors(checkpoint)
    rank, alpha = state.lora["rank"], state.lora["alpha"]
    out: dict[str, torch.Tensor] = {}
    rank_pattern, alpha_pattern = {}, {}
    for module, members in _modules(cfg).items():
        adapted = [name for name in members if name + ".lora_a" in tensors]
        if not adapted:
            continue
        k = len(adapted)
        a = torch.cat([tensors[name + ".lora_a"] for name in adapted])  # (k r, in)
        total = sum(rows for _, rows in members.values())
        b = a.new_zeros(total, k * rank)  # (out, k r): member j's rows use columns [j r, (j + 1) r)
        for j, name in enumerate(adapted):
            start, rows = members[name]
            b[start:start + rows, j * rank:(j + 1) * rank] = tensors[name + ".lora_b"]
        out[f"{PREFIX}{module}.lora_A.weight"], out[f"{PREFIX}{module}.lora_B.weight"] = a, b
        if k > 1:
            rank_pattern[module], alpha_pattern[module] = k * rank, k * alpha
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = "" if state.base.startswith("init:") else state.base
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "lora_dropout": state.lora["dropout"], "target_modules": sorted(m for m in _modules(cfg)
                                                                              if f"{PREFIX}{m}.lora_A.weight" in out),
              "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "bias": "none",
              "fan_in_fan_out": getattr(hf, "LORA_FAN_IN_FAN_OUT", False), "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "base_model_name_or_path": base}
    write_safetensors(out, out_dir / WEIGHTS_FILE)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key that is the module's name or a dotted tail of it."""
    hits = [v for k, v in patterns.items() if module == k or module.endswith("." + k)]
    return hits[0] if hits else default


def import_peft(adapter_dir: str | Path, out_dir: str | Path, base: str | Path) -> Path:
    """Turn a PEFT LoRA adapter directory into a run directory of adapters on the polytrain `base`
    (a run or checkpoint, e.g. `polytrain convert HF_DIR` of the model the adapter was trained on)."""
    from polytrain.checkpoint import save_weights
    from polytrain.checkpoint.trainer_state import read_state
    from polytrain.convert import resolve_checkpoint
    from polytrain.models.registry import shape_config

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{adapter_dir / CONFIG_FILE} is a {config.get('peft_type')} adapter; polytrain imports LORA")
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            raise ConfigError(f"{adapter_dir / CONFIG_FILE} sets {key}; polytrain's LoRA is the plain form")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise ConfigError(f"{adapter_dir / CONFIG_FILE} also trains biases or whole modules; polytrain imports "
                          "LoRA adapters alone (bias = 'none', no modules_to_save)")
    base_checkpoint, base_run = resolve_checkpoint(base)
    if read_state(base_checkpoint).lora is not None:
        raise ConfigError(f"{base_checkpoint} holds LoRA adapters itself; name the checkpoint of the base "
                          "model (e.g. the step_0 of its `polytrain convert HF_DIR` run) with --base")
    cfg = load_config(RunDir(base_run).config)
    if not (adapter_dir / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"{adapter_dir} has no {WEIGHTS_FILE} (save the adapter with safe_serialization)")
    tensors = load_file(adapter_dir / WEIGHTS_FILE)
    adapters = _split_adapters(config, tensors, _modules(cfg))
    unused = sorted(set(tensors) - {f"{PREFIX}{m}.{w}.weight" for m in adapters["modules"] for w in ("lora_A", "lora_B")})
    if unused:
        raise CheckpointError(f"{adapter_dir} holds tensors no polytrain {cfg.model.arch} layer takes: {unused[0]}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"output directory {out_dir} exists and is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.lora = LoRAConfig(rank=adapters["rank"], alpha=adapters["alpha"], dropout=config.get("lora_dropout", 0.0),
                          targets=_targets(list(adapters["tensors"]), cfg.model.n_layers), only_optimize=True)
    cfg.run.name, cfg.run.out_dir = out_dir.name, str(out_dir.resolve())
    run = RunDir(out_dir)
    if RunDir(base_run).tokenizer.is_file():
        shutil.copyfile(RunDir(base_run).tokenizer, run.tokenizer)
        cfg.data.tokenizer = str(run.tokenizer.resolve())
    run.config.write_text(to_toml(cfg))
    state = {f"{name}.{part}": t for name, pair in adapters["tensors"].items() for part, t in zip(("lora_a", "lora_b"), pair)}
    save_weights(run.checkpoints / "step_0", state, shape_config(cfg.model), lora=cfg.lora,
                 base=str(base_checkpoint.resolve()))
    return out_dir


def _split_adapters(config: dict, tensors: dict[str, torch.Tensor], modules: dict[str, dict[str, tuple[int, int]]]) -> dict:
    """Each polytrain layer's (A, B) at one rank and scale from PEFT's per-module adapters."""
    r, alpha = config["r"], config["lora_alpha"]
    found: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}  # polytrain layer -> (A, B, scale)
    used = []
    for module, members in modules.items():
        key = f"{PREFIX}{module}.lora_A.weight"
        if key not in tensors:
            continue
        used.append(module)
        a, b = tensors[key].float(), tensors[f"{PREFIX}{module}.lora_B.weight"].float()  # (r_m, in), (out, r_m)
        r_m = _pattern_value(config.get("rank_pattern") or {}, module, r)
        scale = _pattern_value(config.get("alpha_pattern") or {}, module, alpha) / r_m
        n = len(members)
        blocks = n > 1 and r_m % n == 0 and all(
            not b[s:s + rows].index_fill(1, torch.arange(j * r_m // n, (j + 1) * r_m // n), 0).any()
            for j, (s, rows) in enumerate(members.values()))
        for j, (name, (start, rows)) in enumerate(members.items()):
            if blocks:  # our own stacked export: member j owns columns [j r, (j + 1) r)
                cols = slice(j * r_m // n, (j + 1) * r_m // n)
                found[name] = (a[cols], b[start:start + rows, cols], scale)
            else:
                found[name] = (a, b[start:start + rows], scale)
    if not found:
        raise CheckpointError("the adapter holds no LoRA weights for any layer of the base model")
    rank = max(a.shape[0] for a, _, _ in found.values())
    scale = next(iter(found.values()))[2]
    padded = {}
    for name, (a, b, s) in found.items():
        extra = rank - a.shape[0]  # zero rows of A and columns of B add nothing to B A
        padded[name] = (torch.cat([a, a.new_zeros(extra, a.shape[1])]),
                        torch.cat([b * (s / scale), b.new_zeros(b.shape[0], extra)], dim=1))
    return {"rank": rank, "alpha": scale * rank, "tensors": padded, "modules": used}


def _targets(names: list[str], n_layers: int) -> str:
    """lora.targets picking exactly `names` (polytrain layer names): block-relative names when each
    of the `n_layers` blocks has the same ones, else the full names."""
    by_block: dict[str, set[str]] = {}
    for name in names:
        _, block, rest = name.split(".", 2)
        by_block.setdefault(rest, set()).add(block)
    blocks = {str(i) for i in range(n_layers)}
    if all(bs == blocks for bs in by_block.values()):
        return ",".join(by_block)
    return ",".join(names)
