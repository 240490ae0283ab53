#!/usr/bin/env bash
# GPU smoke test: one command on a machine with an NVIDIA GPU, after a checkout.
#
#   scripts/gpu_smoke.sh [--out DIR]
#       The GPU set (`.[dev,gpu]`: vllm + CUDA torch, from the package registry) in .venv-gpu,
#       then tests/gpu, the vLLM contract tests on CUDA and a 3-step main job (vLLM engine,
#       DeepSpeed learner on the GPU).
#   scripts/gpu_smoke.sh --learner [--bundle DIR] [--out DIR]
#       No vLLM, no Ray, no network: the machine's own Python with CUDA torch and
#       transformers (python3, or STPPO_GPU_PYTHON), plus what it lacks from the offline
#       bundle made here by `scripts/gpu_bundle.py prepare` (default .gpu-bundle: wheels and
#       a tokenizer-only SmolLM2 folder), installed with no index into .cache/gpu-site
#       (STPPO_GPU_SITE). Runs tests/gpu (the DeepSpeed learner on CUDA, the HF engine on CUDA
#       against the learner's log-probs), the HF engine contract tests, and measures the
#       learner step (policy + critic + reference, random-init SmolLM2-135M, bf16, ZeRO-2)
#       and the HF engine's generation on CUDA (also two calls merged into one).
#   scripts/gpu_smoke.sh --scale [--with-3b] [--bundle DIR] [--out DIR]
#       The --learner install, the CUDA packing, budget and compile tests, and the learner at
#       a size users train: random SmolLM2-1.7B shapes, policy + critic + reference, bf16
#       ZeRO-2, 64 trajectories; st_ppo and so_grpo on the chunked path (micro-batches of 4),
#       packed rows with compiled decoder layers, one row per micro-batch with the varlen
#       attention (eager, and compiled at 8,192 tokens and at the memory-sized budget), side
#       by side, with the share of the bf16 peak and peak memory (280 s on an H200 with
#       the install and the tests, before `varlen`).
#       --with-3b adds one st_ppo step at a Llama-3.2-3B shape with gradient
#       checkpointing and packed micro-batches of 8,192 tokens (a GPU of 140 GiB: the 3B
#       policy and critic with their AdamW states take ~127 GiB, the step peaks near 132).
#   scripts/gpu_smoke.sh --job [--bundle DIR] [--out DIR]
#       The whole job on one GPU, no network: the --learner install plus the job's wheels
#       (Ray, FastAPI, BM25), joined from the parts `scripts/gpu_bundle.py prepare --job` made
#       (carried one part per command; `join` names what is missing), then the synthetic task
#       (`prepare-synthetic`, no download) trained for 4 RL steps: local Ray, the HF engine on
#       CUDA in the rollout actor and the DeepSpeed learner on CUDA sharing the GPU (0.5 each),
#       object-store weight sync, the retrieval server on the CPU.
#
# Every mode writes DIR/report.txt and DIR/figures.json (default DIR runs/gpu_smoke), plus
# DIR/details/ (test reports, benchmark JSON and logs). Every step that fails stops the
# script with "[gpu-smoke] FAILED ..." on stderr and a non-zero exit, except the test and
# benchmark steps: those are all run, each failure is named in the report and the exit is 1.
# No CUDA device: exit 3 after the install and import checks, "no CUDA device" in the
# report (what the CPU test tests/integration/test_gpu_smoke_offline.py checks).
# Weight sync in the full mode uses the collective transport (nccl) with two or more GPUs;
# with one, learner and engine share it and NCCL cannot put two ranks on one device, so the
# object store.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

MODE=full
WITH_3B=0
OUT_DIR=runs/gpu_smoke
BUNDLE=.gpu-bundle
while (($#)); do
  case "$1" in
    --learner) MODE=learner ;;
    --scale) MODE=scale ;;
    --job) MODE=job ;;
    --with-3b) WITH_3B=1 ;;
    --out) OUT_DIR=${2:?--out needs a directory}; shift ;;
    --bundle) BUNDLE=${2:?--bundle needs a directory}; shift ;;
    -h | --help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    *) echo "[gpu-smoke] unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT_DIR/details"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
DETAILS=$OUT_DIR/details

log() { echo "[gpu-smoke] $*"; }

# stop REASON CODE: write a report saying where the run stopped, then exit CODE
stop() {
  echo "[gpu-smoke] FAILED: $1" >&2
  printf '[gpu-smoke] report (%s)\n  status   stopped: %s\n' "$MODE" "$1" >"$OUT_DIR/report.txt"
  # the reason goes through the environment, not the code: it may hold quotes
  STOP_REASON=$1 STOP_MODE=$MODE "${PY:-python3}" -c 'import json, os, sys; json.dump({"mode": os.environ["STOP_MODE"], "status": "stopped", "reason": os.environ["STOP_REASON"]}, open(sys.argv[1], "w"), indent=2)' \
    "$OUT_DIR/figures.json" 2>/dev/null || true
  exit "$2"
}
# any other failed command stops the run the same way, naming the line and the command
trap 'stop "exit $? at scripts/gpu_smoke.sh line $LINENO: $BASH_COMMAND" 1' ERR

# ------------------------------------------------------------------ interpreter and packages
if [[ "$MODE" == full ]]; then
  VENV=${STPPO_GPU_VENV:-.venv-gpu}
  [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet -e ".[dev,gpu]"
  PY="$VENV/bin/python"
else
  PY=${STPPO_GPU_PYTHON:-python3}
  command -v "$PY" >/dev/null || stop "no Python at '$PY' (set STPPO_GPU_PYTHON)" 1
  [[ -d "$BUNDLE/wheels" ]] || stop "no wheel folder $BUNDLE/wheels: make the bundle with 'scripts/gpu_bundle.py prepare' (README, GPU users) and bring it along" 1
  BUNDLE=$(cd "$BUNDLE" && pwd)
  SITE=${STPPO_GPU_SITE:-$ROOT/.cache/gpu-site}
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PIP_NO_INDEX=1
  export STPPO_DATA_DIR=${STPPO_DATA_DIR:-$BUNDLE/data}
  log "python $("$PY" -c 'import sys; print(sys.version.split()[0], "at", sys.executable)')"
  force=()
  [[ "${STPPO_GPU_FORCE_INSTALL:-0}" == 1 ]] && force=(--force)
  "$PY" scripts/gpu_bundle.py install --bundle "$BUNDLE" --target "$SITE" "${force[@]}"
  if [[ "$MODE" == job ]]; then
    "$PY" scripts/gpu_bundle.py join --bundle "$BUNDLE" \
      || stop "the job's wheels are not all here: carry the missing parts of $BUNDLE/job-parts" 1
    "$PY" scripts/gpu_bundle.py install --bundle "$BUNDLE" --target "$SITE" --job "${force[@]}"
  fi
fi
IMPORTS="torch transformers pydantic tenacity deepspeed pytest learner.trainer actors.engines.hf actors.retrieval_client"
if [[ "$MODE" == job ]]; then
  IMPORTS="$IMPORTS ray fastapi uvicorn bm25s services.driver"
fi

# one interpreter for the three checks (importing torch + DeepSpeed is the slow part)
MODEL=${STPPO_DATA_DIR:-data}/model/smollm2-135m-instruct
log "imports, model folder $MODEL, CUDA"
# (bm25s runs a JAX top-k at import: JAX stays on the CPU, as in retrieval_server.retrievers)
JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} "$PY" - "$MODEL" "$DETAILS/cuda.txt" $IMPORTS <<'EOF'
import importlib
import sys
from pathlib import Path

for name in sys.argv[3:]:
    module = importlib.import_module(name)
    version = getattr(module, "__version__", "")
    print(f"[gpu-smoke]   {name:24s} {version:14s} {module.__file__}")

from transformers import AutoConfig, AutoTokenizer

config = AutoConfig.from_pretrained(sys.argv[1])
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print(f"[gpu-smoke]   model: {config.model_type}, {config.num_hidden_layers} layers, "
      f"hidden {config.hidden_size}, tokenizer of {len(tok)} tokens")

import torch

count = torch.cuda.device_count() if torch.cuda.is_available() else 0
name = torch.cuda.get_device_name(0) if count else "-"
Path(sys.argv[2]).write_text(f"{torch.__version__} {torch.version.cuda} {count} {name}\n")
EOF

# ------------------------------------------------------------------ the first CUDA check
read -r torch_version cuda_version ngpu gpu_name <"$DETAILS/cuda.txt"
((ngpu > 0)) || stop "no CUDA device: torch $torch_version (CUDA $cuda_version) sees none" 3
log "torch $torch_version, CUDA $cuda_version, $ngpu GPU(s): $gpu_name"

# peak GPU memory over the whole smoke run (all processes), sampled every second
sampler=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 1 >"$DETAILS/gpu_memory.csv" &
  sampler=$!
  # and per process, with its title (Ray names its actors' processes ray::ClassName...)
  (while true; do
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      while IFS=', ' read -r pid mem; do
        echo "$pid $mem $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-60)"
      done
    sleep 1
  done) >"$DETAILS/gpu_processes.txt" &
  sampler="$sampler $!"
  trap 'kill $sampler 2>/dev/null || true' EXIT
fi

# ------------------------------------------------------------------ tests and measurements
failed=()
# run NAME COMMAND...: run a test or benchmark step; a failure is named, not fatal
run() {
  local name=$1 rc=0
  shift
  log "$name: $*"
  "$@" || rc=$?
  if ((rc != 0)); then
    echo "[gpu-smoke] FAILED: $name (exit $rc)" >&2
    failed+=("$name")
  fi
}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o junit_family=xunit1)  # xunit1: test properties
if [[ "$MODE" == scale ]]; then
  run tests_gpu "${PYTEST[@]}" --junitxml="$DETAILS/tests_gpu.xml" \
    -k "packed or budget or compiled" tests/gpu/test_learner_cuda.py
  # the issue-46 batch: 64 trajectories spread like the main job's, 4 optimizer steps;
  # compiled: packed rows with inductor-compiled decoder layers; varlen: one row per
  # micro-batch and torch's FlashAttention varlen kernel (each path warmed up once before
  # the rounds); @8192 a budget under the chunked path's memory;
  # --profile: one more step of each variant on the last path, its CUDA kernel time by category
  run scale_1.7b "$PY" benchmarks/learner_step.py --shape 1.7b --model "$MODEL" \
    --dtype bf16 --zero-stage 2 --repeats 2 --batch 64 --mini 16 --micro 4 \
    --micro-tokens -1 --variants st_ppo,so_grpo \
    --paths chunked,compiled,varlen,compiled_varlen@8192,compiled_varlen \
    --no-sft \
    --profile \
    --out "$DETAILS/scale_1.7b.json"
  if ((WITH_3B)); then
    run scale_3b "$PY" benchmarks/learner_step.py --shape 3b --model "$MODEL" \
      --dtype bf16 --zero-stage 2 --repeats 1 --batch 64 --mini 16 --micro 4 \
      --variants st_ppo --paths packed@8192 --no-sft --gradient-checkpointing \
      --out "$DETAILS/scale_3b.json"
  fi
else
  run tests_gpu "${PYTEST[@]}" --junitxml="$DETAILS/tests_gpu.xml" tests/gpu
fi
if [[ "$MODE" == full ]]; then
  run tests_contract "${PYTEST[@]}" --junitxml="$DETAILS/tests_contract.xml" \
    tests/integration/test_engines_contract.py tests/integration/test_weight_group.py
  transport=object_store; learner_gpus=0.5; engine_gpus=0.5
  if ((ngpu >= 2)); then transport=collective; learner_gpus=1; engine_gpus=1; fi
  run prepare "$VENV/bin/stppo" prepare
  run main_job "$VENV/bin/stppo" train @deploy/configs/cpu_demo.toml \
    run.name=gpu_smoke run.output_dir="$DETAILS" run.num_steps=3 run.eval_questions=8 \
    sft.num_demonstrations=16 ray.num_cpus="$(nproc)" \
    ray.learner_gpus=$learner_gpus ray.rollout_actor_gpus=$engine_gpus \
    rollout.vllm_kv_cache_gib=4 \
    sync.transport=$transport
elif [[ "$MODE" == job ]]; then
  run tests_gpu "${PYTEST[@]}" --junitxml="$DETAILS/tests_gpu.xml" -k build_engine \
    tests/gpu/test_hf_engine_cuda.py
  run prepare_synthetic "$PY" -m services.cli prepare-synthetic
  run main_job "$PY" -m services.cli train @deploy/configs/synthetic.toml \
    run.name=gpu_smoke run.output_dir="$DETAILS" run.num_steps=4 ray.num_cpus="$(nproc)" \
    ray.learner_gpus=0.5 ray.rollout_actor_gpus=0.5 sync.transport=object_store
elif [[ "$MODE" == learner ]]; then
  # the HF engine's contract (its vLLM cases are marked `vllm`: not installed here)
  run tests_contract "${PYTEST[@]}" --junitxml="$DETAILS/tests_contract.xml" -m "not vllm" \
    tests/integration/test_engines_contract.py
  # the README's learner benchmark batch (8 trajectories, lengths spread like the main job's),
  # then a larger one; old, chunked and new code paths side by side, share of the GPU's peak
  run learner_step "$PY" benchmarks/learner_step.py --random-init --model "$MODEL" \
    --dtype bf16 --zero-stage 2 --repeats 3 --paths old,chunked,new \
    --out "$DETAILS/learner_step.json"
  run learner_step_b64 "$PY" benchmarks/learner_step.py --random-init --model "$MODEL" \
    --dtype bf16 --zero-stage 2 --repeats 3 --batch 64 --mini 32 --micro 16 \
    --micro-tokens 16384 --variants ppo,st_ppo,so_grpo --paths old,chunked,new \
    --out "$DETAILS/learner_step_b64.json"
  run hf_engine "$PY" benchmarks/hf_engine.py --random-init --model "$MODEL" --device cuda \
    --out "$DETAILS/hf_engine.json"
  # two rollout calls' turns one after the other vs merged into one engine call (what
  # rollout.calls_per_actor > 1 asks of the engine): 8 rows at ~300 and 8 at ~900 tokens
  run hf_engine_merge "$PY" benchmarks/hf_engine.py --random-init --model "$MODEL" --device cuda \
    --batch 8 --repeats 5 --merge-contexts 300,900 --out "$DETAILS/hf_engine_merge.json"
fi
[[ -n "$sampler" ]] && kill $sampler 2>/dev/null || true

# ------------------------------------------------------------------ report
"$PY" - "$OUT_DIR" "$MODE" "${failed[*]:-}" <<'EOF'
import json
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, mode, failed = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split()
details = out / "details"
figures = {"mode": mode, "status": "failed" if failed else "passed", "failed_steps": failed,
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
lines = [f"[gpu-smoke] report ({mode}) on {figures['device']}, torch {torch.__version__}"]


def read_json(name):
    path = details / name
    return json.loads(path.read_text()) if path.exists() else None


for name in ("tests_gpu", "tests_contract"):
    path = details / f"{name}.xml"
    if path.exists():
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        figures[name] = counts
        for case in suite.iter("testcase"):  # what tests recorded (record_property)
            props = {p.get("name"): float(p.get("value")) for p in case.iter("property")}
            if props:
                figures.setdefault(f"{name}_properties", {})[case.get("name")] = props
        lines.append(f"  {name:24s} {counts['passed']} passed, {counts['failures']} failed, "
                     f"{counts['errors']} errors, {counts['skipped']} skipped")
for case, props in figures.get("tests_gpu_properties", {}).items():
    lines.append(f"    {case}: " + ", ".join(f"{k} {v:.2e}" for k, v in props.items()))
for name in ("learner_step", "learner_step_b64", "scale_1.7b", "scale_3b"):
    bench = read_json(f"{name}.json")
    if bench is None:
        continue
    rows = {f"{r['step']} [{r['path']}]": r for r in bench["rows"]}
    figures[name] = {
        "batch": bench["batch"], "config": {k: bench["config"][k] for k in ("dtype", "zero_stage", "micro_batch_size")},
        "init_s": bench["init_s"], "peak_gpu_allocated_gib": bench["peak_gpu_allocated_gib"],
        "matmul": bench["matmul"],
        **{key: {v: r.get(key) for v, r in rows.items()}
           for key in ("step_s_median", "tokens_per_s", "model_tflop", "share_of_peak",
                       "speedup_vs_first_path", "peak_gpu_allocated_gib")},
    }
    peak = bench["matmul"].get("peak_tflops") or float("nan")
    if "shape" in bench:
        figures[name].update({k: bench.get(k) for k in ("shape", "parameters", "fused_adamw", "varlen_kernel", "auto_micro_batch_tokens")})
        lines.append(f"  {name}: shape {bench['shape']}, {bench['parameters'] / 1e9:.2f} B parameters, "
                     f"fused AdamW {bench['fused_adamw']}, varlen kernel {bench.get('varlen_kernel')}, "
                     f"memory token budget {bench['auto_micro_batch_tokens']}")
    lines.append(f"  {name}: {bench['batch']['trajectories']} trajectories, {bench['batch']['tokens']} "
                 f"tokens/step, bf16 ZeRO-{bench['config']['zero_stage']}, peak GPU allocated "
                 f"{bench['peak_gpu_allocated_gib']:.2f} GiB, init {bench['init_s']:.1f} s, "
                 f"bf16 peak [8192^3] {peak:.0f} TFLOP/s")
    for v, r in rows.items():
        share = r.get("share_of_peak") or float("nan")
        lines.append(f"    {v:24s} step {r['step_s_median']:.3f} s   {r['tokens_per_s']:8.0f} tokens/s   "
                     f"{r['model_tflop']:.2f} TFLOP   share of peak {share:.4f}   "
                     f"x first path {r['speedup_vs_first_path']:.2f}   "
                     f"peak GPU {r.get('peak_gpu_allocated_gib') or float('nan'):.1f} GiB")
engine = read_json("hf_engine.json")
if engine is not None:
    figures["hf_engine"] = engine
    lines.append(f"  HF engine on CUDA        {engine['tokens_per_s']:.0f} tokens/s ({engine['batch']} x "
                 f"{engine['new_tokens']} new tokens, {engine['dtype']}), peak GPU allocated "
                 f"{engine['peak_gpu_allocated_gib']:.2f} GiB")
merge_bench = read_json("hf_engine_merge.json") or {}
merge = merge_bench.get("merge")
if merge is not None:
    merge_rows = merge_bench["batch"]
    figures["hf_engine_merge"] = {k: v for k, v in merge.items() if k != "seconds_all"}
    lines.append(f"  HF engine, two calls     {merge_rows} x {merge['contexts'][0]} + {merge_rows} x {merge['contexts'][1]} context tokens: "
                 f"{merge['sequential_s']:.2f} s one after the other, {merge['merged_s']:.2f} s merged "
                 f"({merge['merge_speedup']:.2f}x)")
steps_file = details / "gpu_smoke" / "steps.jsonl"  # the full mode's main job
if steps_file.exists():
    steps = [json.loads(line) for line in steps_file.read_text().splitlines()]

    def med(key):
        vals = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
        return statistics.median(vals) if vals else float("nan")

    phases = ("rollout_tokens_per_s", "step_s", "tokens_per_s", "weight_sync_s", "rollout_s_mean", "wall_s")
    figures["main_job"] = {k: med(k) for k in phases}
    figures["main_job"]["rl_steps"] = len(steps)
    lines.append(f"  per RL step (median)     wall {med('wall_s'):.2f} s, rollout call {med('rollout_s_mean'):.2f} s, "
                 f"learner step {med('step_s'):.2f} s, weight sync {med('weight_sync_s'):.2f} s")
    lines.append(f"  engine tokens/s          {med('rollout_tokens_per_s'):.0f}")
    lines.append(f"  learner step seconds     {med('step_s'):.2f}  (tokens/s {med('tokens_per_s'):.0f})")
    lines.append(f"  weight-sync seconds      {med('weight_sync_s'):.2f}  (learner side; engine loads overlap)")
    lines.append(f"  RL steps                 {len(steps)}")
procs_file = details / "gpu_processes.txt"
if procs_file.exists():  # peak GPU memory per process title (engine actor, learner actor...)
    peaks = {}
    for line in procs_file.read_text().splitlines():
        fields = line.split(maxsplit=2)
        if len(fields) >= 2 and fields[1].isdigit():
            words = fields[2].split() if len(fields) == 3 else []
            title = words[0] if words else f"pid {fields[0]}"
            if title.startswith("ray::"):  # ray::LearnerActor.step -> ray::LearnerActor
                title = title.split(".")[0]
            elif Path(title).name.startswith("python") and "-m" in words[1:2] and len(words) > 2:
                title = f"python -m {words[2]}"  # python3 -m retrieval_server, -m services.cli
            peaks[title] = max(peaks.get(title, 0), int(fields[1]))
    figures["peak_gpu_memory_by_process_gib"] = {t: m / 1024 for t, m in peaks.items()}
    for title, mib in sorted(peaks.items(), key=lambda kv: -kv[1]):
        lines.append(f"  peak GPU memory {title[:28]:28s} {mib / 1024:.1f} GiB")
mem_file = details / "gpu_memory.csv"
if mem_file.exists():
    mem = [int(x) for x in mem_file.read_text().split() if x.isdigit()]
    figures["peak_gpu_memory_used_gib"] = max(mem, default=0) / 1024
    lines.append(f"  peak GPU memory used     {figures['peak_gpu_memory_used_gib']:.1f} GiB (nvidia-smi, whole run)")
lines.append(f"  status                   {figures['status']}" + (f": {', '.join(failed)}" if failed else ""))
(out / "report.txt").write_text("\n".join(lines) + "\n")
(out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
print("\n".join(lines))
EOF
((${#failed[@]} == 0)) || exit 1
