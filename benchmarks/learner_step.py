"""Learner step time, tokens/s, model FLOPs and share of the matmul bound, old and new paths.

One :class:`learner.trainer.Learner` (policy + critic + frozen reference under DeepSpeed) on
SmolLM2-135M-Instruct (``--random-init``: same shapes, random weights); the same batch is
trained on by each variant in turn (``set_algorithm``, as the control plane does live), and
by the warm start's SFT step (``supervised_step``). Every (variant or SFT, code path) pair
runs once per round, rounds repeated ``--repeats`` times after one warm-up step, so drift in
machine load (2 shared cores here) hits all of them alike; medians are reported.

Code paths (``--paths``), switched on the same learner in the same process:

- ``old``: full-vocabulary logits of every response column (``logprob_chunk_tokens = 0``),
  ``--micro`` trajectories per micro-batch;
- ``chunked``: log-probs and entropy through the LM head in chunks, policy tokens only
  (``logprob_chunk_tokens = 512``, :mod:`learner.logprobs`), micro-batches as ``old``;
- ``new``: ``chunked`` and micro-batches by a token budget of 1,024 padded slots
  (``micro_batch_tokens``, :func:`learner.micro_batches.token_budget_micro_batches`);
- ``packed``: ``new`` with every forward on the micro-batch's trajectories packed without
  padding (``pack_sequences``, :mod:`learner.packing`), the budget counting real tokens;
- ``compiled``: ``packed`` with each decoder layer's attention, MLP and norms compiled by
  TorchInductor (``compile_layers``, :class:`learner.modeling.LayerCompiler`); the compile
  happens in a warm-up step of its own, before the measured rounds (its seconds are printed);
- ``varlen``: ``packed`` with every trajectory of a micro-batch in one row and the
  variable-length attention (``packed_attention = "varlen"``, :mod:`learner.attention`:
  torch's FlashAttention varlen kernel on CUDA) instead of rows with a block mask;
- ``compiled_varlen``: ``varlen`` with compiled decoder layers.

Every path other than the learner's own config gets one warm-up step before the rounds.

``--micro-tokens`` sets the budget of ``new`` and ``packed``; -1 sizes it from the memory
free after the models are loaded (``micro_batch_tokens = -1``,
:func:`learner.micro_batches.memory_token_budget`), settled after the first step from what it
measured; ``--gpu-memory-fraction`` keeps it within a share of the GPU, ``--gpu-memory-gib``
within so many GiB (steps compared at a memory ceiling: issue 46 started from 66.7 GiB).

Model shapes (``--shape``, random weights with the project's tokenizer; implies
``--random-init``): ``135m`` is SmolLM2-135M's own config, ``360m`` and ``1.7b``
SmolLM2-360M's and SmolLM2-1.7B's (hidden, layers, heads, intermediate), ``3b`` Llama-3.2-3B's
(hidden 3072, 28 layers, 24 heads of which 8 key-value, intermediate 8192), ``tiny`` the
tests' two-layer Llama (hidden 64, intermediate 128: the step is almost all host work), all
with the SmolLM2 vocabulary of 49,152 and tied embeddings. ``--gradient-checkpointing`` recomputes
activations in backward (what the 3B shape needs on one GPU beside its critic and
reference). On CUDA the optimizer is the fused AdamW (``learner.fused_adamw``).

Batches (``--lengths``): ``uniform`` is the old benchmark's (``--turns`` turns of
``--turn-tokens`` policy tokens between ``--info-tokens`` information tokens, all equal);
``spread`` draws each trajectory's shape like the main job's rollouts (``cpu_demo.toml``:
1-3 turns of at most 64 policy tokens, information blocks of 3 passages, 8 trajectories of
about 6,100 tokens in the issue-31 profile), so micro-batches carry padding as in the job.
Behaviour log-probs are the reference model's plus Gaussian noise (``--logprob-noise``).

Model FLOPs (linear layers only, as the issue defines them; attention scores and
elementwise work are not counted). Per token of a forward, from the model config::

    backbone = 2 * layers * (H*q + 2*H*kv + q*H + 3*H*I)   q = heads*head_dim,
                                                            kv = kv_heads*head_dim
    head     = 2 * H * V                                    (LM head, per policy token)

With N real tokens (prompt + response, no padding) and N_pol policy tokens, a policy or
reference forward is ``F_pol = backbone*N + head*N_pol`` (the objective needs log-probs of
policy tokens only), a critic forward ``F_crit = backbone*N``, and a backward twice its
forward. One RL step is::

    F_pol (reference) + [critic] F_crit (old values) + [decoupled, recomputed] F_pol (proximal)
    + epochs * (3 F_pol + [critic] 3 F_crit + [scale_target = loss] F_pol + [param] 3 F_pol)

and one SFT step ``3 F_pol``. The matmul bound is FLOPs / R, where R is the rate of a
[4096 x H] x [H x I] matmul in the learner's dtype with the learner's threads, measured in
this process once per round (the best round is R); share = bound / step seconds. On a GPU
the same shape is far too small to reach the chip's rate, so the step is also put against
the GPU's bf16 peak, P: the rate of an [8192 x 8192] x [8192 x 8192] matmul in the
learner's dtype, measured once per round (best round); share of peak = FLOPs / P / step
seconds.

Peak memory per step: the resident-set high-water mark of this process, reset before each
step (``/proc/self/clear_refs`` after ``malloc_trim``), in GiB; on a GPU also the step's
peak of allocated GPU memory (``torch.cuda.max_memory_allocated`` after a reset), and the
caching allocator's ``cudaMalloc`` calls and allocation retries in the step (a retry frees
cached blocks, synchronising the device: the step runs at the edge of memory).

``--count-syncs``: after the measured rounds, one more step per (variant or SFT, path)
with its host syncs counted (:func:`host_syncs.count_syncs` (benchmarks/host_syncs.py): on CUDA the
synchronising calls PyTorch reports, on the CPU those its simulation of a device finds),
as ``host_syncs_per_step`` and the sites (``host_sync_sites``) in each row.

``--profile``: after the measured rounds, one more step of each variant (and SFT) on the
last path under ``torch.profiler``; its self time (CPU; on a GPU the CUDA kernels' time,
each kernel counted once, under the operator that launched it) is grouped by operator into
matmul, attention, softmax / log-sum-exp, dtype copies, elementwise, optimizer and the
rest (:func:`op_category`, :func:`summarize_profile`), printed with the step's wall
seconds (the GPU's idle time is the difference) and written under ``"profile"`` (a list,
one per step).

Run (shared machine: take the heavy lock)::

    flock .cache/heavy.lock .venv/bin/python benchmarks/learner_step.py --lengths spread \\
        --batch 8 --variants st_ppo,so_grpo --repeats 2 --out runs/benchmarks/learner.json
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.env import configure_local_caches

configure_local_caches()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from host_syncs import count_syncs  # noqa: E402

from actors.prompts import prompt_ids  # noqa: E402
from actors.trajectory import Trajectory  # noqa: E402
from learner.attention import uses_varlen_kernel  # noqa: E402
from learner.batch import collate_trajectories  # noqa: E402
from learner.config import (  # noqa: E402
    VARIANT_CONFIGS,
    LearnerConfig,
    PPOConfig,
    STPPOConfig,
    uses_bias_correction,
    uses_critic,
)
from learner.engines import use_fused_adamw  # noqa: E402
from learner.modeling import response_logits, token_logprobs  # noqa: E402
from learner.trainer import Learner  # noqa: E402

VARIANTS = {name: cls() for name, cls in VARIANT_CONFIGS.items()}
VARIANTS["st_ppo/param"] = STPPOConfig(bias_norm="param")
# the decoupled objective recomputes the proximal log-probs (one policy forward per step);
# the log-linear proximal (learner.corrections) approximates them without that forward
VARIANTS["ppo/decoupled"] = PPOConfig(off_policy="decoupled")
VARIANTS["ppo/loglinear"] = PPOConfig(off_policy="decoupled", proximal="loglinear")

PATHS = {
    "old": {"logprob_chunk_tokens": 0, "micro_batch_tokens": 0},
    "chunked": {"logprob_chunk_tokens": 512, "micro_batch_tokens": 0},
    "new": {"logprob_chunk_tokens": 512, "micro_batch_tokens": 1024},
}
PATHS["packed"] = {**PATHS["new"], "pack_sequences": True}
PATHS["compiled"] = {**PATHS["packed"], "compile_layers": True}
PATHS["varlen"] = {**PATHS["packed"], "packed_attention": "varlen"}
PATHS["compiled_varlen"] = {**PATHS["varlen"], "compile_layers": True}
"""LearnerConfig overrides of each code path (see the module docstring)."""


def _rss_gib() -> float:
    """Current resident set size of this process in GiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**30


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _reset_peak_rss() -> bool:
    """Give freed heap back to the OS and reset the RSS high-water mark (VmHWM); False where
    the kernel does not allow it (then per-step peaks are process peaks)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_gib() -> float:
    """The RSS high-water mark since the last reset, GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


SHAPES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128,
    },
    "135m": {},
    "360m": {
        "hidden_size": 960, "num_hidden_layers": 32, "num_attention_heads": 15,
        "num_key_value_heads": 5, "intermediate_size": 2560,
    },
    "1.7b": {
        "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 32, "intermediate_size": 8192,
    },
    "3b": {
        "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
        "num_key_value_heads": 8, "intermediate_size": 8192,
    },
}  # fmt: skip
"""``--shape``: overrides of SmolLM2-135M's config.json (module docstring)."""


def path_config(path: str, path_configs: dict[str, dict]) -> dict:
    """LearnerConfig overrides of ``path``: a name of :data:`PATHS`, optionally ``@budget``
    (e.g. ``packed@4096``: that path at a micro-batch token budget of 4,096; -1: from free
    memory).

    Raises:
        ValueError: an unknown path name or a budget on a path without one.
    """
    name, _, budget = path.partition("@")
    if name not in path_configs:
        raise ValueError(f"unknown path {name!r}: expected one of {sorted(path_configs)}")
    config = dict(path_configs[name])
    if budget:
        if not config["micro_batch_tokens"]:
            raise ValueError(f"path {name!r} cuts micro-batches by count: no @budget")
        config["micro_batch_tokens"] = int(budget)
    return config


def _random_init_copy(model_dir: Path, seed: int, shape: str = "135m") -> Path:
    """A model folder with ``model_dir``'s tokenizer, its config with :data:`SHAPES`
    ``[shape]`` applied, and random bf16 weights (made on the GPU when there is one)."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    out = Path(tempfile.mkdtemp(prefix="bench-model-"))
    config = AutoConfig.from_pretrained(model_dir)
    for key, value in SHAPES[shape].items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    del model
    return out


def _peak_gpu_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _reset_peak_gpu() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _allocator_counts() -> tuple[int, int]:
    """(``cudaMalloc`` calls, allocation retries) of the CUDA caching allocator so far; (0, 0)
    off CUDA. A retry frees cached blocks, which synchronises the device, and allocates
    again: a step that retries runs at the edge of memory."""
    if not torch.cuda.is_available():
        return 0, 0
    stats = torch.cuda.memory_stats()
    return int(stats.get("num_device_alloc", 0)), int(stats.get("num_alloc_retries", 0))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def flops_per_token(model_config) -> tuple[float, float]:
    """(backbone, LM head) linear-layer FLOPs of one token's forward (module docstring)."""
    hidden = int(model_config.hidden_size)
    heads = int(model_config.num_attention_heads)
    head_dim = int(getattr(model_config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = (
        hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * model_config.intermediate_size
    )
    backbone = 2.0 * model_config.num_hidden_layers * per_layer
    return backbone, 2.0 * hidden * model_config.vocab_size


def step_flops(algorithm, model_config, num_tokens: int, num_policy: int, epochs: int) -> float:
    """Model FLOPs of one RL step of ``algorithm`` (``None``: one SFT step)."""
    backbone, head = flops_per_token(model_config)
    policy = backbone * num_tokens + head * num_policy
    critic = backbone * num_tokens
    if algorithm is None:
        return 3.0 * policy
    gae = uses_critic(algorithm)
    total = policy + (critic if gae else 0.0)
    recompute = algorithm.off_policy == "decoupled" and algorithm.proximal == "recompute"
    total += policy if recompute else 0.0
    per_epoch = 3.0 * policy + (3.0 * critic if gae else 0.0)
    if uses_bias_correction(algorithm):
        if algorithm.bias_norm == "param":
            per_epoch += 3.0 * policy
        elif algorithm.scale_target == "loss":
            per_epoch += policy
    return total + epochs * per_epoch


def _best_matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, device, repeats: int) -> float:
    """FLOP/s of an [m x k] x [k x n] matmul: the best of ``repeats`` timed after 3 warm-ups."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        a @ b
        _sync()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best


def matmul_rate(hidden: int, intermediate: int, dtype: torch.dtype, device) -> float:
    """FLOP/s of a [4096 x hidden] x [hidden x intermediate] matmul (best of 20 after 3)."""
    return _best_matmul_rate(4096, hidden, intermediate, dtype, device, repeats=20)


def peak_matmul_rate(dtype: torch.dtype, device, size: int = 8192) -> float:
    """FLOP/s of a [size x size] x [size x size] matmul on ``device`` (best of 10 after 3):
    the accelerator's practical peak in ``dtype``, the ceiling a GPU step is put against."""
    return _best_matmul_rate(size, size, size, dtype, device, repeats=10)


OP_CATEGORIES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention", "_cudnn_attention")),
    ("softmax / log-sum-exp", ("softmax", "logsumexp")),
    ("dtype copies", ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous")),
    ("optimizer", ("adam", "_foreach", "optimizer", "step")),
    ("elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::exp", "aten::neg",
                     "aten::pow", "aten::rsqrt", "aten::silu", "aten::where", "aten::amax",
                     "aten::sum", "aten::mean", "aten::clamp", "aten::fill_", "aten::zero_",
                     "aten::gather", "aten::masked", "aten::log", "aten::sigmoid", "aten::max",
                     "aten::min", "aten::abs", "aten::cat", "aten::index", "aten::embedding",
                     "aten::scatter", "aten::cos", "aten::sin", "aten::minimum", "aten::maximum",
                     "aten::sqrt", "aten::norm", "aten::lt", "aten::gt", "aten::eq", "aten::ne",
                     "aten::ge", "aten::le", "aten::bitwise", "aten::logical")),
)  # fmt: skip
"""(category, operator-name fragments) in match order: the first category whose fragment is
in an operator's lower-cased name takes it. Self time only: autograd nodes (``MmBackward0``)
hold almost none, the ``aten`` ops they run hold it."""


def op_category(name: str) -> str:
    """The :data:`OP_CATEGORIES` category of a profiler event name, or ``"other"``."""
    lowered = name.lower()
    for category, fragments in OP_CATEGORIES:
        if any(fragment.lower() in lowered for fragment in fragments):
            return category
    return "other"


def profile_step(run_step, on_gpu: bool, top: int = 15) -> dict:
    """Run ``run_step()`` once under ``torch.profiler``; :func:`summarize_profile` of it,
    with the step's wall seconds (``wall_s``, profiler overhead included)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run_step()
        _sync()
        wall_s = time.perf_counter() - start
    return {**summarize_profile(prof.key_averages(), on_gpu, top), "wall_s": wall_s}


def summarize_profile(events, on_gpu: bool, top: int = 15) -> dict:
    """Self time of a profiled step by :func:`op_category`, and its top operators.

    On the CPU: every operator's self CPU time. On a GPU, where kernels are what takes time,
    the profiler lists each kernel twice: as a device event, and inside the self device time
    of the operator that launched it (``FunctionEventAvg.self_device_time_total``). Summing
    both counted every kernel twice (and the kernel rows, named after CUDA kernels, all as
    "other"), so the busy time is the device events' (user annotations' device spans left
    out), the categories are the operators', and kernel time no operator launched is
    "not under an operator". On the CPU a user annotation's self time is its own (Python)
    work and counts; the ProfilerStep marker never does.

    Args:
        events: ``prof.key_averages()``: items with ``key``, ``device_type``,
            ``self_cpu_time_total``, ``self_device_time_total`` (microseconds) and
            ``is_user_annotation``.
        on_gpu: whether device time is what is summarised.
        top: how many operators (and, on a GPU, kernels) to list.

    Returns:
        ``{"time_s", "clock", "by_category": {category: share of time_s}, "top": [[op,
        seconds]]}``, and on a GPU ``"top_kernels"``. ``time_s``: the summed self time (on a
        GPU, the kernels' busy time; against ``wall_s`` it shows how long the GPU idled).
    """
    from torch.autograd import DeviceType

    on_cpu = [
        e
        for e in events
        if e.device_type == DeviceType.CPU and not e.key.startswith("ProfilerStep")
    ]
    clock = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    ops = [(e.key, getattr(e, clock) / 1e6) for e in on_cpu]
    ops = [(name, t) for name, t in ops if t > 0]
    total = sum(t for _, t in ops)
    kernels: list[tuple[str, float]] = []
    if on_gpu:
        kernels = [
            (e.key, e.self_device_time_total / 1e6)
            for e in events
            if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
        ]
        busy = sum(t for _, t in kernels)
        if busy > total:
            ops.append(("(kernels not under an operator)", busy - total))
        total = max(busy, total)
    by_category: dict[str, float] = {}
    for name, t in ops:
        category = op_category(name)
        by_category[category] = by_category.get(category, 0.0) + t / (total or 1.0)
    ops.sort(key=lambda e: -e[1])
    summary = {
        "time_s": total,
        "clock": "self CUDA" if on_gpu else "self CPU",
        "by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top": [[name, t] for name, t in ops[:top]],
    }
    if on_gpu:
        kernels.sort(key=lambda e: -e[1])
        summary["top_kernels"] = [[name, t] for name, t in kernels[:top]]
    return summary


def _turn_shapes(args: argparse.Namespace, rng: np.random.Generator) -> list[tuple[list, list]]:
    """Per trajectory: (policy tokens per turn, information tokens after each non-last turn)."""
    if args.lengths == "uniform":
        return [
            ([args.turn_tokens] * args.turns, [args.info_tokens] * (args.turns - 1))
            for _ in range(args.batch)
        ]
    shapes = []
    for _ in range(args.batch):
        # main job: max_turns 3, max_new_tokens_per_turn 64 (a turn often hits the cap),
        # 3 passages of ~33 words per information block
        turns = int(rng.choice([1, 2, 3], p=[0.2, 0.35, 0.45]))
        policy = [int(min(64, rng.integers(12, 90))) for _ in range(turns)]
        info = [int(rng.integers(180, 380)) for _ in range(turns - 1)]
        shapes.append((policy, info))
    return shapes


def synthetic_batch(learner: Learner, args: argparse.Namespace) -> list[Trajectory]:
    """``--batch`` trajectories in groups of 2: the chat prompt, then policy turns separated
    by information tokens, shaped by ``--lengths`` (:func:`_turn_shapes`)."""
    rng = np.random.default_rng(args.seed)
    vocab = len(learner.tokenizer)
    record = {
        "id": "bench",
        "question": "What is the capital of the country whose "
        "largest airport is Jorge Chavez International?",
        "data_source": "multi_hop",
    }
    prompt = prompt_ids(learner.tokenizer, record)
    out = []
    for i, (policy, info) in enumerate(_turn_shapes(args, rng)):
        response, mask, turns = [], [], []
        for turn, length in enumerate(policy):
            response += rng.integers(100, vocab, length).tolist()
            mask += [1] * length
            turns += [turn] * length
            if turn < len(info):
                response += rng.integers(100, vocab, info[turn]).tolist()
                mask += [0] * info[turn]
                turns += [-1] * info[turn]
        out.append(
            Trajectory(
                prompt_ids=np.asarray(prompt, dtype=np.int64),
                response_ids=np.asarray(response, dtype=np.int64),
                loss_mask=np.asarray(mask, dtype=np.int8),
                turn_ids=np.asarray(turns, dtype=np.int32),
                behavior_logprobs=np.zeros(len(response), dtype=np.float32),
                reward=float(i % 2),
                success=bool(i % 2),
                num_searches=len(policy) - 1,
                num_turns=len(policy),
                policy_version_min=0,
                policy_version_max=0,
                group_id=f"g{i // 2}",
                question_id=f"bench/{i}",
                data_source="multi_hop",
                finish_reason="answer",
            )
        )
    # behaviour log-probs: reference log-probs + noise (clipped to <= 0)
    batch = collate_trajectories(out, learner.pad_token_id)
    with torch.no_grad():
        for b, traj in enumerate(out):
            row = batch.select([b]).to(learner.device)
            logp = token_logprobs(response_logits(learner.reference_engine, row), row.response_ids)
            noisy = logp[0].float().cpu().numpy() + rng.normal(
                0.0, args.logprob_noise, logp.shape[1]
            )
            traj.behavior_logprobs = np.minimum(noisy, 0.0).astype(np.float32) * traj.loss_mask
    return [t.validate() for t in out]


def padded_tokens(trajectories: list[Trajectory], micro: int) -> int:
    """Tokens the padded micro-batches of ``micro`` trajectories (in order) hold."""
    total = 0
    for s in range(0, len(trajectories), micro):
        chunk = trajectories[s : s + micro]
        width = max(len(t.prompt_ids) for t in chunk) + max(t.num_response_tokens for t in chunk)
        total += width * len(chunk)
    return total


def gpu_memory_fraction(args: argparse.Namespace) -> float:
    """``--gpu-memory-fraction``, or ``--gpu-memory-gib`` over the GPU's total (at most 1)."""
    if args.gpu_memory_gib <= 0.0 or not torch.cuda.is_available():
        return args.gpu_memory_fraction
    total = torch.cuda.get_device_properties(0).total_memory
    return min(1.0, args.gpu_memory_gib * 2**30 / total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="data/model/smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=8, help="trajectories per step")
    parser.add_argument("--mini", type=int, default=4, help="mini-batch size (optimizer step)")
    parser.add_argument("--micro", type=int, default=2, help="micro-batch size")
    parser.add_argument("--lengths", default="spread", choices=["spread", "uniform"])
    parser.add_argument("--turns", type=int, default=3, help="uniform: turns per trajectory")
    parser.add_argument("--turn-tokens", type=int, default=64, help="uniform: tokens per turn")
    parser.add_argument("--info-tokens", type=int, default=128, help="uniform: info tokens")
    parser.add_argument("--logprob-noise", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=2, help="measured rounds")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--variants", default="st_ppo,so_grpo", help=f"of {','.join(VARIANTS)}")
    parser.add_argument(
        "--paths", default="old,new", help=f"of {','.join(PATHS)}, each optionally @budget"
    )
    parser.add_argument(
        "--micro-tokens",
        type=int,
        default=PATHS["new"]["micro_batch_tokens"],
        help="the new and packed paths' micro-batch token budget (new: padded slots; "
        "packed: real tokens; -1: sized from free memory)",
    )
    parser.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=1.0,
        help="learner.gpu_memory_fraction: the share of the GPU a -1 budget plans for",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=0.0,
        help="the same as GiB of this GPU (--gpu-memory-fraction = GiB / the GPU's total)",
    )
    parser.add_argument("--shape", default=None, choices=list(SHAPES), help="model shape")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--no-sft", action="store_true", help="skip the SFT step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-s",
        type=float,
        default=0.0,
        help="start no round after this many seconds (0: no limit)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON")
    parser.add_argument(
        "--count-syncs",
        action="store_true",
        help="count each step's and path's host syncs in one more step (see the docstring)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one more step of each variant on the last path (see the docstring)",
    )
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="random weights from --model's config.json and tokenizer (same shapes and cost; "
        "for a machine the 270 MB weights cannot reach)",
    )
    args = parser.parse_args()
    path_configs = {
        name: {**path, "micro_batch_tokens": args.micro_tokens}
        if path["micro_batch_tokens"]
        else path
        for name, path in PATHS.items()
    }
    for path in args.paths.split(","):
        path_config(path, path_configs)  # an unknown path fails before the models load
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.random_init or args.shape:
        args.model = str(_random_init_copy(Path(args.model), args.seed, args.shape or "135m"))

    config = LearnerConfig(
        zero_stage=args.zero_stage,
        dtype=args.dtype,
        train_batch_size=args.batch,
        mini_batch_size=args.mini,
        micro_batch_size=args.micro,
        actor_lr=1e-6,
        critic_lr=1e-5,
        gradient_checkpointing=args.gradient_checkpointing,
        gpu_memory_fraction=gpu_memory_fraction(args),
    )
    rss_start = _rss_gib()
    t0 = time.perf_counter()
    learner = Learner(args.model, config, STPPOConfig(), seed=args.seed)
    init_s = time.perf_counter() - t0
    rss_after_init = _rss_gib()
    trajectories = synthetic_batch(learner, args)
    num_tokens = sum(len(t.prompt_ids) + t.num_response_tokens for t in trajectories)
    num_policy = sum(t.num_policy_tokens for t in trajectories)
    num_parameters = sum(p.numel() for p in learner.policy_engine.module.parameters())
    model_config = learner.policy_engine.module.config
    dtype = learner.dtype_choice.torch_dtype
    names = [n for n in args.variants.split(",") if n] + ([] if args.no_sft else ["sft"])
    paths = args.paths.split(",")
    base = learner.config
    varlen_on_kernel = uses_varlen_kernel(learner.device, learner.dtype_choice.torch_dtype)
    print(
        f"init {init_s:.1f} s, RSS {rss_after_init:.2f} GiB; dtype {learner.dtype_choice.name}, "
        f"threads {torch.get_num_threads()}; {len(trajectories)} trajectories, {num_tokens} "
        f"tokens ({num_policy} policy; {padded_tokens(trajectories, args.micro)} in padded "
        f"micro-batches of {args.micro}); shape {args.shape or '135m'}, "
        f"{num_parameters / 1e9:.2f} B "
        f"parameters, fused AdamW {use_fused_adamw(learner.config)}, varlen attention "
        f"{'FlashAttention kernel' if varlen_on_kernel else 'per-trajectory SDPA'}, "
        f"memory token budget "
        f"{learner.micro_batches.auto_micro_batch_tokens}",
        flush=True,
    )

    def run(name: str, path: str) -> tuple[float, float, float, dict]:
        """One step; (seconds, peak RSS GiB, peak GPU allocated GiB, metrics)."""
        learner.config = base.model_copy(update=path_config(path, path_configs))
        reset = _reset_peak_rss()
        _reset_peak_gpu()
        mallocs, retries = _allocator_counts()
        if name == "sft":
            metrics = learner.supervised_step(trajectories)
        else:
            learner.set_algorithm(VARIANTS[name])
            metrics = learner.step(trajectories)
        peak = _hwm_gib() if reset else _peak_rss_gib()
        after = _allocator_counts()
        allocator = {"gpu_mallocs": after[0] - mallocs, "alloc_retries": after[1] - retries}
        return metrics.step_s, peak, _peak_gpu_gib(), {**dataclass_dict(metrics), **allocator}

    rates: list[float] = []
    peak_rates: list[float] = []
    on_gpu = learner.device.type == "cuda"
    learner.set_algorithm(VARIANTS["st_ppo"])
    learner.step(trajectories)  # warm-up (allocator, first touch of the optimizer states)
    # one warm-up step per other code path (its name without the budget): a compiled path
    # compiles there (graphs with and without grad) and a varlen path loads its kernels,
    # outside the measured rounds; a path that fails is dropped and the rest still measured
    # (a GPU window is short)
    compile_s: dict[str, float] = {}
    for kind in dict.fromkeys(p.partition("@")[0] for p in paths):
        if not any(v != getattr(base, k) for k, v in path_config(kind, path_configs).items()):
            continue  # the warm-up above ran this one (the learner's own config)
        learner.config = base.model_copy(update=path_config(kind, path_configs))
        t0 = time.perf_counter()
        try:
            learner.step(trajectories)
        except Exception as error:
            dropped = [p for p in paths if p.partition("@")[0] == kind]
            print(f"  warm-up FAILED, paths {dropped} dropped: {error!r}", flush=True)
            paths = [p for p in paths if p not in dropped]
        else:
            seconds = time.perf_counter() - t0
            if path_config(kind, path_configs).get("compile_layers"):
                compile_s[kind] = seconds
            print(f"  warm-up step [{kind}]: {seconds:.1f} s", flush=True)
        learner.config = base
    times: dict[tuple[str, str], list[float]] = {(n, p): [] for n in names for p in paths}
    peaks: dict[tuple[str, str], list[float]] = {(n, p): [] for n in names for p in paths}
    gpu_peaks: dict[tuple[str, str], list[float]] = {(n, p): [] for n in names for p in paths}
    last: dict[tuple[str, str], dict] = {}
    probe = learner.micro_batches.memory_probe
    measured = (
        f" (measured: states {probe.state_bytes / 2**30:.1f} GiB, optimizer step peak "
        f"{probe.optimizer_peak_bytes / 2**30:.1f} GiB, "
        f"{probe.bytes_per_token / 2**10:.0f} KiB per token)"
        if probe.optimizer_steps
        else ""
    )
    print(
        f"  warm-up step done, RSS {_rss_gib():.2f} GiB, memory token budget "
        f"{learner.micro_batches.auto_micro_batch_tokens}{measured}",
        flush=True,
    )
    bench_start = time.perf_counter()
    for round_index in range(1, args.repeats + 1):
        if round_index > 1 and args.max_s > 0 and time.perf_counter() - bench_start > args.max_s:
            print(f"  --max-s {args.max_s:.0f} reached: {round_index - 1} rounds", flush=True)
            args.repeats = round_index - 1
            break
        rates.append(
            matmul_rate(model_config.hidden_size, model_config.intermediate_size, dtype,
                        learner.device)
        )  # fmt: skip
        if on_gpu:
            peak_rates.append(peak_matmul_rate(dtype, learner.device))
        for name in names:
            for path in paths:
                step_s, peak, gpu_peak, metrics = run(name, path)
                allocator = (
                    f", cudaMalloc {metrics['gpu_mallocs']}, alloc retries "
                    f"{metrics['alloc_retries']}"
                    if on_gpu
                    else ""
                )
                print(
                    f"  round {round_index} {name} [{path}]: {step_s:.2f} s, peak RSS "
                    f"{peak:.2f} GiB, matmul {rates[-1] / 1e12:.2f} TFLOP/s{allocator}",
                    flush=True,
                )
                times[(name, path)].append(step_s)
                peaks[(name, path)].append(peak)
                gpu_peaks[(name, path)].append(gpu_peak)
                last[(name, path)] = metrics

    syncs: dict[tuple[str, str], Counter[str]] = {}
    if args.count_syncs:  # one more step per (step, path), not timed
        for name in names:
            for path in paths:
                counted = count_syncs(
                    lambda name=name, path=path: run(name, path), learner.engines, learner.device
                )
                syncs[(name, path)] = counted
                top = ", ".join(f"{site} x{n}" for site, n in counted.most_common(4))
                print(
                    f"  host syncs {name} [{path}]: {counted.total()} per step ({top})",
                    flush=True,
                )
    profiles = []
    path = paths[-1]
    for name in names if args.profile else []:
        summary = profile_step(lambda name=name: run(name, path), on_gpu)
        profile = {"step": name, "path": path, **summary}
        profiles.append(profile)
        print(
            f"profile of {name} [{path}] ({profile['clock']} time {profile['time_s']:.2f} s "
            f"of {profile['wall_s']:.2f} s wall): "
            + ", ".join(f"{c} {share:.2f}" for c, share in profile["by_category"].items()),
            flush=True,
        )
        for op, t in profile["top"]:
            print(f"    {t:8.3f} s  {op}  [{op_category(op)}]")
        for kernel, t in profile.get("top_kernels", []):
            print(f"    {t:8.3f} s  kernel {kernel[:100]}")
    rate = max(rates)
    peak_rate = max(peak_rates) if peak_rates else None
    rows = []
    for name in names:
        algorithm = None if name == "sft" else VARIANTS[name]
        flops = step_flops(algorithm, model_config, num_tokens, num_policy, config.ppo_epochs)
        old_s = statistics.median(times[(name, paths[0])])
        for path in paths:
            median_s = statistics.median(times[(name, path)])
            metrics = last[(name, path)]
            rows.append(
                {
                    "step": name,
                    "path": path,
                    "step_s_median": median_s,
                    "step_s_all": times[(name, path)],
                    "tokens_per_s": num_tokens
                    * (1 if algorithm is None else config.ppo_epochs)
                    / median_s,
                    "model_tflop": flops / 1e12,
                    "bound_s": flops / rate,
                    "share_of_bound": flops / rate / median_s,
                    "speedup_vs_first_path": old_s / median_s,
                    "peak_rss_gib": max(peaks[(name, path)]),
                    "share_of_peak": flops / peak_rate / median_s if peak_rate else None,
                    "peak_gpu_allocated_gib": max(gpu_peaks[(name, path)]) if on_gpu else None,
                    "loss": metrics.get("loss", metrics.get("pg_loss")),
                    "entropy": metrics.get("entropy"),
                    "proximal_approx_abs_error": metrics.get("proximal_approx_abs_error"),
                    "gpu_mallocs_last_round": metrics["gpu_mallocs"] if on_gpu else None,
                    "alloc_retries_last_round": metrics["alloc_retries"] if on_gpu else None,
                    "host_syncs_per_step": syncs[(name, path)].total() if syncs else None,
                    "host_sync_sites": dict(syncs[(name, path)].most_common()) if syncs else None,
                }
            )
    result = {
        "model": args.model,
        "config": config.model_dump(),
        "dtype": learner.dtype_choice.name,
        "batch": {
            "lengths": args.lengths,
            "trajectories": len(trajectories),
            "tokens": num_tokens,
            "policy_tokens": num_policy,
            "padded_tokens": padded_tokens(trajectories, args.micro),
            "per_trajectory": [len(t.prompt_ids) + t.num_response_tokens for t in trajectories],
        },
        "threads": torch.get_num_threads(),
        "memory_probe": {
            **dataclasses.asdict(learner.micro_batches.memory_probe),
            "bytes_per_token": learner.micro_batches.memory_probe.bytes_per_token,
        },
        "matmul": {
            "shape": [4096, model_config.hidden_size, model_config.intermediate_size],
            "tflops_per_round": [r / 1e12 for r in rates],
            "tflops": rate / 1e12,
            "peak_shape": [8192, 8192, 8192] if peak_rate else None,
            "peak_tflops_per_round": [r / 1e12 for r in peak_rates],
            "peak_tflops": peak_rate / 1e12 if peak_rate else None,
        },
        "init_s": init_s,
        "compile_warmup_s": compile_s or None,
        "rss_start_gib": rss_start,
        "rss_after_init_gib": rss_after_init,
        "peak_rss_gib": _peak_rss_gib(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "peak_gpu_allocated_gib": _peak_gpu_gib(),
        "random_init": args.random_init or bool(args.shape),
        "shape": args.shape or "135m",
        "parameters": num_parameters,
        "fused_adamw": use_fused_adamw(learner.config),
        "varlen_kernel": varlen_on_kernel,
        "auto_micro_batch_tokens": learner.micro_batches.auto_micro_batch_tokens,
        "rows": rows,
        "profile": profiles or None,
    }
    print(
        f"init {init_s:.1f} s; {len(trajectories)} trajectories ({args.lengths}), {num_tokens} "
        f"tokens, {num_policy} policy; dtype {result['dtype']}, threads "
        f"{torch.get_num_threads()}; matmul [4096 x {model_config.hidden_size}] x "
        f"[{model_config.hidden_size} x {model_config.intermediate_size}] "
        f"{rate / 1e12:.2f} TFLOP/s (rounds: "
        f"{', '.join(f'{r / 1e12:.2f}' for r in rates)}); device {result['device']}"
        + (f"; peak [8192^3] {peak_rate / 1e12:.0f} TFLOP/s" if peak_rate else "")
    )
    print(
        f"| step | path | step s (median of {args.repeats}) | tokens/s | model TFLOP | "
        f"bound s | share of bound | x {paths[0]} | peak RSS GiB |"
        + (" share of peak | peak GPU GiB |" if peak_rate else "")
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if peak_rate else ""))
    for r in rows:
        print(
            f"| {r['step']} | {r['path']} | {r['step_s_median']:.2f} | {r['tokens_per_s']:.0f} "
            f"| {r['model_tflop']:.2f} | {r['bound_s']:.2f} | {r['share_of_bound']:.3f} | "
            f"{r['speedup_vs_first_path']:.2f} | {r['peak_rss_gib']:.2f} |"
            + (
                f" {r['share_of_peak']:.4f} | {r['peak_gpu_allocated_gib']:.2f} |"
                if peak_rate
                else ""
            )
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


def dataclass_dict(metrics) -> dict:
    """A step's metrics as a plain dict (StepMetrics and SupervisedStepMetrics)."""
    import dataclasses

    return dataclasses.asdict(metrics)


if __name__ == "__main__":
    main()
