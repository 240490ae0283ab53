"""Learner step time, tokens/s and peak memory for every ST-PPO variant, side by side.

One :class:`learner.trainer.Learner` (policy + critic + frozen reference under DeepSpeed) on
the real SmolLM2-135M-Instruct; the same synthetic batch of multi-turn trajectories is
trained on by each variant in turn (``set_algorithm``, as the control plane does live). The
variants are interleaved round-robin over the repeats, so drift in machine load (2 shared
cores here) hits all of them alike; the median step time per variant is reported.

The batch is shaped like a search-agent rollout: the real chat prompt of a QA question,
then ``--turns`` policy turns separated by information blocks. Behaviour log-probs are the
reference model's log-probs plus Gaussian noise (``--logprob-noise``), so ratios and
clipping look like a moderately off-policy batch.

Targets (issue 6): st_ppo <= 1.05x ppo step time with ``bias_norm = logprob``; the cost of
``bias_norm = param``; peak RSS of a full step with policy + critic + reference <= 12 GB.

Run (shared machine: take the heavy lock)::

    flock .cache/heavy.lock .venv/bin/python benchmarks/learner_step.py --repeats 3 \\
        --out runs/benchmarks/learner.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.env import configure_local_caches

configure_local_caches()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from actors.prompts import prompt_ids  # noqa: E402
from actors.trajectory import Trajectory  # noqa: E402
from learner.batch import collate_trajectories  # noqa: E402
from learner.config import VARIANT_CONFIGS, LearnerConfig, STPPOConfig  # noqa: E402
from learner.modeling import response_logits, token_logprobs  # noqa: E402
from learner.trainer import Learner  # noqa: E402

VARIANTS = {name: cls() for name, cls in VARIANT_CONFIGS.items()}
VARIANTS["st_ppo/param"] = STPPOConfig(bias_norm="param")


def _rss_gib() -> float:
    """Current resident set size of this process in GiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**30


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _random_init_copy(model_dir: Path, seed: int) -> Path:
    """A model folder with ``model_dir``'s config and tokenizer and random weights."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    out = Path(tempfile.mkdtemp(prefix="bench-model-"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def _peak_gpu_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def synthetic_batch(learner: Learner, args: argparse.Namespace) -> list[Trajectory]:
    """``--batch`` trajectories in groups of 2: chat prompt, then ``--turns`` policy turns of
    ``--turn-tokens`` tokens separated by ``--info-tokens`` information tokens."""
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
    for i in range(args.batch):
        response, mask, turns = [], [], []
        for turn in range(args.turns):
            response += rng.integers(100, vocab, args.turn_tokens).tolist()
            mask += [1] * args.turn_tokens
            turns += [turn] * args.turn_tokens
            if turn < args.turns - 1:
                response += rng.integers(100, vocab, args.info_tokens).tolist()
                mask += [0] * args.info_tokens
                turns += [-1] * args.info_tokens
        out.append(
            Trajectory(
                prompt_ids=np.asarray(prompt, dtype=np.int64),
                response_ids=np.asarray(response, dtype=np.int64),
                loss_mask=np.asarray(mask, dtype=np.int8),
                turn_ids=np.asarray(turns, dtype=np.int32),
                behavior_logprobs=np.zeros(len(response), dtype=np.float32),
                reward=float(i % 2),
                success=bool(i % 2),
                num_searches=args.turns - 1,
                num_turns=args.turns,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="data/model/smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=4, help="trajectories per step")
    parser.add_argument("--micro", type=int, default=2, help="micro-batch size")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--info-tokens", type=int, default=128)
    parser.add_argument("--logprob-noise", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per variant")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON")
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="random weights from --model's config.json and tokenizer (same shapes and cost; "
        "for a machine the 270 MB weights cannot reach)",
    )
    args = parser.parse_args()
    if args.random_init:
        args.model = str(_random_init_copy(Path(args.model), args.seed))

    config = LearnerConfig(
        zero_stage=args.zero_stage,
        dtype=args.dtype,
        train_batch_size=args.batch,
        mini_batch_size=args.batch,
        micro_batch_size=args.micro,
        actor_lr=1e-6,
        critic_lr=1e-5,
    )
    rss_start = _rss_gib()
    t0 = time.perf_counter()
    learner = Learner(args.model, config, STPPOConfig(), seed=args.seed)
    init_s = time.perf_counter() - t0
    rss_after_init = _rss_gib()
    trajectories = synthetic_batch(learner, args)
    num_tokens = sum(len(t.prompt_ids) + t.num_response_tokens for t in trajectories)
    names = args.variants.split(",")

    learner.set_algorithm(VARIANTS["ppo"])
    print(f"init {init_s:.1f} s, RSS {rss_after_init:.2f} GiB; {num_tokens} tokens", flush=True)
    learner.step(trajectories)  # warm-up (allocator, first-touch of optimizer states)
    print(f"  warm-up done, RSS {_rss_gib():.2f} GiB (peak {_peak_rss_gib():.2f})", flush=True)
    times: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name in names:
            learner.set_algorithm(VARIANTS[name])
            metrics = learner.step(trajectories)
            print(
                f"  {name}: {metrics.step_s:.2f} s, RSS {_rss_gib():.2f} GiB "
                f"(peak {_peak_rss_gib():.2f})",
                flush=True,
            )
            times[name].append(metrics.step_s)
            last[name] = metrics.to_dict()

    ppo_s = statistics.median(times["ppo"]) if "ppo" in times else float("nan")
    rows = []
    for name in names:
        median_s = statistics.median(times[name])
        rows.append(
            {
                "variant": name,
                "step_s_median": median_s,
                "step_s_all": times[name],
                "tokens_per_s": num_tokens / median_s,
                "vs_ppo": median_s / ppo_s,
                "clip_ratio": last[name]["clip_ratio"],
                "clip_bias_norm": last[name]["clip_bias_norm"],
                "clip_bias_scale": last[name]["clip_bias_scale"],
            }
        )
    result = {
        "model": args.model,
        "config": config.model_dump(),
        "batch": {
            "trajectories": args.batch,
            "tokens": num_tokens,
            "policy_tokens": sum(t.num_policy_tokens for t in trajectories),
            "turns": args.turns,
        },
        "threads": torch.get_num_threads(),
        "init_s": init_s,
        "rss_start_gib": rss_start,
        "rss_after_init_gib": rss_after_init,
        "peak_rss_gib": _peak_rss_gib(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "peak_gpu_allocated_gib": _peak_gpu_gib(),
        "random_init": args.random_init,
        "rows": rows,
    }
    print(
        f"init {init_s:.1f} s; batch {args.batch} trajectories, {num_tokens} tokens; "
        f"threads {torch.get_num_threads()}; peak RSS {result['peak_rss_gib']:.2f} GiB "
        f"(after init {rss_after_init:.2f} GiB); device {result['device']}, peak GPU "
        f"allocated {result['peak_gpu_allocated_gib']:.2f} GiB"
    )
    print(
        f"| variant | step s (median of {args.repeats}) | tokens/s | x ppo | clip_ratio | "
        "clip_bias_norm | clip_bias_scale |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['step_s_median']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['vs_ppo']:.3f} | {r['clip_ratio']:.3f} | {r['clip_bias_norm']:.4f} | "
            f"{r['clip_bias_scale']:.3f} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
