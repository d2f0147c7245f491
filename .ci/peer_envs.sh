#!/usr/bin/env bash
# Virtualenvs for the peer frameworks whose own pins conflict with polytrain's test environment,
# for the CUDA-shim proofs in tests/compat (test_colossalai.py, test_torchtitan.py):
#   DIR/colossalai  Colossal-AI 0.5.0: pins torch <= 2.5.1 and transformers 4.51.3, so it goes in
#                   with --no-deps beside the runtime dependencies Booster, HybridParallelPlugin
#                   and LowLevelZeroPlugin import (peft, galore_torch with bitsandbytes, ...)
#   DIR/torchtitan  torchtitan 0.3.0 with triton; its wandb/pyrefly/dev extras are not used
# Both run on the CPU torch polytrain is tested with, from the environment this script runs in
# (`python`, the CI venv): each venv reads that environment's site-packages after its own (a .pth
# line), so torch and the packages nobody pins differently are not installed again, and what a
# peer pins (transformers 4.51.3, huggingface_hub < 1, ...) shadows the base's copy. Prints, for
# the tests, the lines
#   export POLYTRAIN_COLOSSALAI_PYTHON=DIR/colossalai/bin/python
#   export POLYTRAIN_TORCHTITAN_PYTHON=DIR/torchtitan/bin/python
# Usage: eval "$(bash .ci/peer_envs.sh DIR)"
set -euo pipefail
dir=$(realpath -m "${1:?usage: peer_envs.sh DIR}")
quiet=(--quiet --disable-pip-version-check)
base=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python -c 'import torch; assert torch.__version__.startswith("2.13.0")' \
    || { echo "peer_envs: run it from the environment with torch 2.13.0 (the CI venv)" >&2; exit 1; }

venv() {  # NAME: a venv that sees the base environment's packages after its own
    python -m venv "$dir/$1"
    local site
    site=$("$dir/$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$base" > "$site/polytrain_ci_base.pth"
}

timed() {  # NAME COMMAND...: run, and report the wall time on stderr
    local name=$1 start=$SECONDS
    shift
    "$@" >&2
    echo "peer_envs: $name installed in $((SECONDS - start)) s" >&2
}

colossalai() {
    venv colossalai
    local pip=("$dir/colossalai/bin/pip" install "${quiet[@]}")
    "${pip[@]}" transformers==4.51.3 accelerate==1.15.0 galore-torch==1.0 \
        bitsandbytes==0.50.2 psutil einops packaging numpy tqdm safetensors
    "${pip[@]}" --no-deps peft==0.13.2
    # An sdist: BUILD_EXT unset builds no CUDA kernels; setuptools comes with the venv.
    "${pip[@]}" --no-deps --no-build-isolation colossalai==0.5.0
}

torchtitan() {
    venv torchtitan
    local pip=("$dir/torchtitan/bin/pip" install "${quiet[@]}")
    "${pip[@]}" triton==3.6.0 torchdata==0.11.0 "datasets==4.7.0" tokenizers \
        safetensors tyro==1.0.17 einops tensorboard spmd_types==0.2.3 torch_checkpointing==0.1.1
    "${pip[@]}" --no-deps torchtitan==0.3.0
}

timed colossalai colossalai
timed torchtitan torchtitan
echo "export POLYTRAIN_COLOSSALAI_PYTHON=$dir/colossalai/bin/python"
echo "export POLYTRAIN_TORCHTITAN_PYTHON=$dir/torchtitan/bin/python"
