"""Hugging Face <-> polytrain: `polytrain convert HF_DIR OUT_DIR` and `--to hf RUN_OR_CKPT OUT_DIR`.

Import writes a polytrain run directory, the same layout `polytrain train` writes,
so everything that reads runs reads it:

    OUT_DIR/config.toml               model section from config.json; data.tokenizer -> the copy below
    OUT_DIR/tokenizer.json            copied from the HF directory (when it has one)
    OUT_DIR/checkpoints/step_0/       a weights-only DCP checkpoint, in the source dtype
    OUT_DIR/hf/                       the HF directory's other small files (config.json,
                                      tokenizer_config.json, generation_config.json, remote
                                      code ...), kept so export writes them back unchanged

`polytrain generate OUT_DIR` samples from it; `polytrain train --config OUT_DIR/config.toml`
fine-tunes it in place (resume = auto finds step_0: weights only, a fresh optimizer,
step 0), and `--checkpoint.resume OUT_DIR/checkpoints/step_0` starts another run from it,
at any parallel layout (DCP reshards). Export reads any checkpoint of a run back into
names, layout and config.json of the `transformers` class (model.safetensors).

Each architecture's names live in polytrain/models/<arch>/hf.py: config_from_hf,
config_to_hf, state_from_hf, state_to_hf; this module owns the files.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from polytrain.checkpoint import RunDir
from polytrain.config import Config, ModelConfig, load_config, to_toml, validate
from polytrain.errors import CheckpointError, ConfigError
from polytrain.io.hf_files import HFTensors, Reader, read_config, write_safetensors
from polytrain.models import ARCHITECTURES
from polytrain.models.registry import resolve_model, shape_config

TOKENIZER = "tokenizer.json"
HF_EXTRAS = "hf"
# Small files of an HF directory worth keeping for the way back (weights and their indexes are not).
_EXTRA_SUFFIXES = (".json", ".py", ".model", ".txt", ".tiktoken", ".jinja")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def arch_of(hf_config: dict) -> str:
    """polytrain architecture of a config.json, by its model_type; ConfigError if there is none."""
    model_type = hf_config.get("model_type")
    for name, arch in ARCHITECTURES.items():
        if model_type in arch.hf_model_types:
            return name
    known = ", ".join(t for a in ARCHITECTURES.values() for t in a.hf_model_types)
    raise ConfigError(f"unknown Hugging Face model_type {model_type!r} "
                      f"(architectures {hf_config.get('architectures')}); polytrain converts: {known}")


def model_config_from_hf(hf_config: dict, names: set[str]) -> ModelConfig:
    """Validated ModelConfig of an HF config.json (names: the checkpoint's tensor names)."""
    arch = arch_of(hf_config)
    try:
        model = ARCHITECTURES[arch].hf().config_from_hf(hf_config, names)
    except KeyError as e:
        raise ConfigError(f"config.json of this {arch} model has no {e.args[0]!r}") from None
    cfg = Config(model=replace(model, size="custom"))
    cfg.data.seq_len = min(cfg.data.seq_len, model.max_seq_len)
    resolve_model(cfg)
    validate(cfg)
    return cfg.model


def state_from_hf(hf_dir: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's state dict (polytrain names) from the HF checkpoint in `hf_dir`, shape-checked."""
    hf = ARCHITECTURES[cfg.arch].hf()
    tensors = HFTensors(hf_dir)
    reader = Reader(tensors, hf.PREFIXES, source=f"the checkpoint in {hf_dir}")
    state = hf.state_from_hf(reader, cfg)
    left = reader.unused(hf.IGNORE)
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise CheckpointError(f"{hf_dir} holds tensors a {cfg.arch} model has no place for: "
                              f"{', '.join(left[:3])}{more}")
    check_shapes(state, cfg, getattr(state, "origin", {}))
    state = dict(state)
    if cfg.tie_embeddings:  # under both names, as the model's (and every checkpoint's) state dict has it
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def check_shapes(state: dict[str, torch.Tensor], cfg: ModelConfig, origin: dict[str, list[str]]) -> None:
    """CheckpointError naming the first tensor whose shape the config does not give, or that is missing."""
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.arch].build(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, shape in expected.items():
        if name not in state:
            if cfg.tie_embeddings and name == "output.weight":
                continue  # the embedding, tied
            raise CheckpointError(f"the checkpoint gives no value for {name}")
        got = tuple(state[name].shape)
        if got != shape:
            source = f" (from {', '.join(origin[name])})" if origin.get(name) else ""
            raise CheckpointError(f"tensor {name}{source} has shape {got}; the config gives {shape}")


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert the Hugging Face model in `hf_dir` into a polytrain run directory `out_dir`."""
    from polytrain.checkpoint import save_weights

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    hf_config = read_config(hf_dir)
    names = set(HFTensors(hf_dir))
    model = model_config_from_hf(hf_config, names)
    state = state_from_hf(hf_dir, model)
    tokenizer = _check_tokenizer(hf_dir / TOKENIZER, model) if (hf_dir / TOKENIZER).is_file() else None
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"output directory {out_dir} exists and is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = Config(model=model)
    # Absolute: `polytrain train --config OUT_DIR/config.toml` then works from any directory.
    cfg.run.name, cfg.run.out_dir = out_dir.name, str(out_dir.resolve())
    cfg.data.seq_len = min(cfg.data.seq_len, model.max_seq_len)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out_dir / TOKENIZER)
        cfg.data.tokenizer = str((out_dir / TOKENIZER).resolve())
    extras = out_dir / HF_EXTRAS
    extras.mkdir()
    for file in sorted(hf_dir.iterdir()):
        if file.is_file() and file.suffix in _EXTRA_SUFFIXES and file.name not in _WEIGHT_INDEXES + (TOKENIZER,):
            shutil.copyfile(file, extras / file.name)
    run = RunDir(out_dir)
    run.config.write_text(to_toml(cfg))
    save_weights(run.checkpoints / "step_0", state, shape_config(model))
    return out_dir


def _check_tokenizer(path: Path, model: ModelConfig) -> Path:
    from polytrain.data.tokenizer import Tokenizer

    size = Tokenizer.load(path).vocab_size
    if size > model.vocab_size:
        raise ConfigError(f"{path} has {size} token ids but the model's vocabulary is {model.vocab_size}")
    return path


def export_hf(source: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Write the model of a run (its newest checkpoint) or of one checkpoint as a Hugging Face directory.

    dtype: "fp32", "bf16" or "fp16" for floating tensors; None keeps each tensor's stored dtype.
    """
    from polytrain.checkpoint import STATE_FILE, check_checkpoint, latest_checkpoint
    from polytrain.checkpoint.consolidate import read_model_tensors

    source, out_dir = Path(source), Path(out_dir)
    if (source / STATE_FILE).is_file():  # a checkpoint: its run is two levels up
        checkpoint, run_dir = source, source.parent.parent
    else:
        run_dir, checkpoint = source, latest_checkpoint(source)
        if not RunDir(run_dir).config.is_file():
            raise ConfigError(f"{source} is neither a polytrain run directory nor a checkpoint")
        if checkpoint is None:
            raise CheckpointError(f"{run_dir} has no complete checkpoint under checkpoints/")
    check_checkpoint(checkpoint)
    if not RunDir(run_dir).config.is_file():
        raise ConfigError(f"{run_dir} (the run of {checkpoint}) has no config.toml")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPES)}")
    run_cfg = load_config(RunDir(run_dir).config)
    cfg = run_cfg.model
    hf = ARCHITECTURES[cfg.arch].hf()
    state = read_model_tensors(checkpoint, DTYPES.get(dtype))
    hf_state = hf.state_to_hf(state, cfg)
    extras = _extras_dir(run_dir, run_cfg)
    base = extras / "config.json"
    hf_config = json.loads(base.read_text()) if base.is_file() else {}
    for derived in ("rope_parameters", "dense_act_fn", "is_gated_act"):  # rewritten from ours below
        hf_config.pop(derived, None)
    hf_config.update(hf.config_to_hf(cfg))
    floating = {t.dtype for t in hf_state.values() if t.is_floating_point()}
    if len(floating) == 1:
        # transformers 4 reads torch_dtype, 5 reads dtype
        hf_config["torch_dtype"] = hf_config["dtype"] = str(floating.pop()).removeprefix("torch.")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(hf_state, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if extras.is_dir():
        for file in extras.iterdir():
            if file.name != "config.json":
                shutil.copyfile(file, out_dir / file.name)
    if (run_dir / TOKENIZER).is_file():
        shutil.copyfile(run_dir / TOKENIZER, out_dir / TOKENIZER)
        if not (out_dir / "tokenizer_config.json").is_file():
            _write_tokenizer_config(run_dir / TOKENIZER, out_dir / "tokenizer_config.json")
    return out_dir


def _extras_dir(run_dir: Path, cfg: Config) -> Path:
    """The kept HF files of a run: its own hf/, or, for a run fine-tuned from an imported model,
    those of the imported directory its tokenizer comes from."""
    if (run_dir / HF_EXTRAS).is_dir() or cfg.data.tokenizer == "bpe":
        return run_dir / HF_EXTRAS
    return Path(cfg.data.tokenizer).parent / HF_EXTRAS


def _write_tokenizer_config(tokenizer: Path, path: Path) -> None:
    """A tokenizer_config.json so AutoTokenizer can load a tokenizer.json trained by polytrain."""
    from polytrain.data.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer)
    eot = tok.hf.id_to_token(tok.eot_id)
    path.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot,
                                "bos_token": eot, "unk_token": eot}, indent=2) + "\n")


def load_hf(hf_dir: str | Path, device: torch.device | str | None = None):
    """(model, tokenizer or None) of a Hugging Face directory, converted in memory; eval mode."""
    from polytrain.data.tokenizer import Tokenizer

    hf_dir = Path(hf_dir)
    cfg = model_config_from_hf(read_config(hf_dir), set(HFTensors(hf_dir)))
    state = state_from_hf(hf_dir, cfg)
    with torch.device("meta"):  # no random init of weights about to be overwritten
        model = ARCHITECTURES[cfg.arch].build(cfg)
    model.to_empty(device=device or "cpu")
    model.load_state_dict(state)
    model.init_buffers()
    tokenizer = Tokenizer.load(hf_dir / TOKENIZER) if (hf_dir / TOKENIZER).is_file() else None
    return model.eval(), tokenizer
