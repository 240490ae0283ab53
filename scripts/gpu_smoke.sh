#!/usr/bin/env bash
# GPU smoke test: one command on a machine with an NVIDIA GPU, after a checkout.
#
#   scripts/gpu_smoke.sh              the GPU set (`.[dev,gpu]`: vllm + CUDA torch) in .venv-gpu,
#                                     then tests/gpu, the vLLM contract tests on CUDA and a
#                                     3-step main job (vLLM engine, DeepSpeed learner on the GPU)
#   scripts/gpu_smoke.sh --learner    no vLLM / Ray: the DeepSpeed learner and the HF engine on
#                                     CUDA only (tests/gpu and the HF contract tests), for machines
#                                     that cannot install vLLM
#
# Needs only the package registries; offline, carry the wheels in and point PIP_FIND_LINKS at
# them with PIP_NO_INDEX=1. The report (engine tokens/s, learner step seconds, weight-sync
# seconds, peak GPU memory) is printed at the end and written to runs/gpu_smoke/report.txt.
# Weight sync uses the collective transport (nccl) with two or more GPUs; with one GPU,
# learner and engine share it and NCCL cannot put two ranks on one device, so the object store.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=full
[[ "${1:-}" == "--learner" ]] && MODE=learner
VENV=${STPPO_GPU_VENV:-.venv-gpu}
OUT=runs/gpu_smoke
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null || { echo "[gpu-smoke] nvidia-smi not found: no NVIDIA GPU here" >&2; exit 1; }
ngpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
echo "[gpu-smoke] $ngpu GPU(s): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"

[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
if [[ "$MODE" == full ]]; then
  "$VENV/bin/pip" install --quiet -e ".[dev,gpu]"
else
  # torch from the machine (or the registry), DeepSpeed + test deps; no vllm, no ray wheels
  "$VENV/bin/pip" install --quiet --no-deps -e . \
    && "$VENV/bin/pip" install --quiet "torch==2.13.0" "transformers==5.19.0" "deepspeed==0.19.8" \
       "accelerate==1.15.0" "safetensors==0.8.0" pydantic pytest pytest-timeout numpy rich
fi
PY="$VENV/bin/python"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch has no CUDA here'; print('[gpu-smoke] torch', torch.__version__, 'cuda', torch.version.cuda)"

# peak GPU memory over the whole smoke run, sampled every second
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 1 > "$OUT/gpu_memory.csv" &
sampler=$!
trap 'kill $sampler 2>/dev/null || true' EXIT

status=0
"$PY" -m pytest -q tests/gpu || status=1
if [[ "$MODE" == full ]]; then
  "$PY" -m pytest -q tests/integration/test_engines_contract.py tests/integration/test_weight_group.py || status=1
  transport=object_store; learner_gpus=0.5; engine_gpus=0.5
  if (( ngpu >= 2 )); then transport=collective; learner_gpus=1; engine_gpus=1; fi
  "$VENV/bin/stppo" prepare
  "$VENV/bin/stppo" train @deploy/configs/cpu_demo.toml \
    run.name=gpu_smoke run.output_dir="$OUT" run.num_steps=3 run.eval_questions=8 \
    sft.num_demonstrations=16 ray.num_cpus="$(nproc)" \
    ray.learner_gpus=$learner_gpus ray.rollout_actor_gpus=$engine_gpus \
    rollout.vllm_kv_cache_gib=4 \
    sync.transport=$transport || status=1
else
  "$PY" -m pytest -q tests/integration/test_engines_contract.py -k "hf" || status=1
fi
kill $sampler 2>/dev/null || true

"$PY" - "$OUT" "$MODE" <<'EOF' | tee "$OUT/report.txt"
import json, statistics, sys
from pathlib import Path
out, mode = Path(sys.argv[1]), sys.argv[2]
mem = [int(x) for x in (out / "gpu_memory.csv").read_text().split() if x.isdigit()]
print(f"[gpu-smoke] report ({mode})")
print(f"  peak GPU memory          {max(mem, default=0) / 1024:.1f} GiB")
steps_file = out / "gpu_smoke" / "steps.jsonl"
if steps_file.exists():
    steps = [json.loads(line) for line in steps_file.read_text().splitlines()]
    def med(key):
        vals = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
        return statistics.median(vals) if vals else float("nan")
    print(f"  engine tokens/s          {med('rollout_tokens_per_s'):.0f}")
    print(f"  learner step seconds     {med('step_s'):.2f}  (tokens/s {med('tokens_per_s'):.0f})")
    print(f"  weight-sync seconds      {med('weight_sync_s'):.2f}  (learner side; engine loads overlap)")
    print(f"  RL steps                 {len(steps)}")
EOF
exit $status
