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
EXTRAS=${STPPO_EXTRAS:-dev}
stamp="$VENV/.stppo-install-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRAS"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  echo "[setup] installing st-ppo[$EXTRAS] (torch==2.13.0 CPU wheel; see README for GPU)"
  start=$(date +%s)
  "$VENV/bin/pip" install --quiet --upgrade pip setuptools wheel
  "$VENV/bin/pip" install --quiet -e ".[$EXTRAS]"
  echo "$want" > "$stamp"
  echo "[setup] packages installed in $(( $(date +%s) - start )) s"
else
  echo "[setup] $VENV up to date"
fi

if [[ "${1:-}" != "--no-assets" ]]; then
  scripts/fetch_debs.sh
  "$VENV/bin/stppo" prepare
fi
