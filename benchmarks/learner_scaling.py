"""The learner on 1 vs 2 ranks (data-parallel DeepSpeed over a Ray actor group, gloo on CPU).

One run, the same synthetic batch for every configuration: ``num_ranks`` 1 and 2 at ZeRO-2
and ZeRO-3, each a fresh :class:`services.learner_group.LearnerGroup`-style group of
:class:`services.learner_group.LearnerRank` actors on a local Ray cluster (fresh processes,
so peak memory is per configuration). Per configuration: the median learner-step time over
``--steps`` steps after one warm-up step, tokens/s (real tokens x epochs / step time), and
per rank the peak RSS (``ru_maxrss`` of the rank's process over its life: each rank loads
full copies of policy, critic and reference before DeepSpeed partitions them, so under ZeRO-3
this peak is set at construction) and the RSS after the measured steps (``VmRSS``: weights,
gradients and Adam state as partitioned, plus the allocator's cached activations) and the seconds spent inside ``torch.distributed`` calls during the
measured steps (wall time of each call, plus of ``wait`` on the handle an asynchronous call
returns).

The model is a random Llama (``--hidden``, ``--layers``; SmolLM2's 49k vocabulary), fp32,
policy + critic + reference per rank: big enough that ZeRO's partitioning shows in RSS, small
enough for a shared 2-core machine. On 2 CPU cores two ranks share the cores: expect no
speed-up; the point is the per-rank memory ZeRO-3 saves and the cost of the collectives.

Run (shared machine: take the heavy lock)::

    flock .cache/heavy.lock .venv/bin/python -m benchmarks.learner_scaling \\
        --out runs/benchmarks/learner_scaling.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.env import configure_local_caches

configure_local_caches()

import numpy as np  # noqa: E402
import ray  # noqa: E402

from actors.trajectory import Trajectory  # noqa: E402
from learner.config import LearnerConfig, STPPOConfig  # noqa: E402
from services.learner_group import LearnerRank  # noqa: E402
from services.ray_actors import _actor_env  # noqa: E402

_COLLECTIVES = (
    "all_reduce", "inference_all_reduce", "all_reduce_coalesced", "all_gather",
    "all_gather_object", "all_gather_into_tensor", "allgather_fn", "all_gather_coalesced",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn", "broadcast", "barrier",
    "reduce", "all_to_all_single",
)  # fmt: skip


def build_model(tokenizer_dir: Path, out: Path, hidden: int, layers: int) -> Path:
    """A random fp32 Llama with ``tokenizer_dir``'s tokenizer, saved to ``out``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_batch(num: int, prompt_len: int, turns: int, turn_len: int, seed: int) -> list[Trajectory]:
    """``num`` trajectories of ``turns`` policy turns (``turn_len`` tokens) separated by
    8-token information blocks, prompt lengths around ``prompt_len``, groups of 2."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        mask: list[int] = []
        turn_ids: list[int] = []
        for t in range(turns):
            mask += [1] * turn_len + ([0] * 8 if t < turns - 1 else [])
            turn_ids += [t] * turn_len + ([-1] * 8 if t < turns - 1 else [])
        n = len(mask)
        m = np.asarray(mask, dtype=np.int8)
        out.append(
            Trajectory(
                prompt_ids=rng.integers(10, 40000, prompt_len + int(rng.integers(0, 16))),
                response_ids=rng.integers(10, 40000, n),
                loss_mask=m,
                turn_ids=np.asarray(turn_ids, dtype=np.int32),
                behavior_logprobs=(-rng.uniform(9.5, 11.5, n) * m).astype(np.float32),
                reward=float(i % 2 == 0),
                success=i % 2 == 0,
                num_searches=turns - 1,
                num_turns=turns,
                policy_version_min=0,
                policy_version_max=0,
                group_id=f"g{i // 2}",
                question_id=f"q{i // 2}",
                data_source="single_hop",
                finish_reason="answer",
            ).validate()
        )
    return out


class _TimedWork:
    """An asynchronous collective's handle whose ``wait`` adds to the rank's collective time."""

    def __init__(self, work, rank: LearnerRank) -> None:
        self._work = work
        self._rank = rank

    def wait(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._rank.collective_s += time.perf_counter() - started

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _instrument(rank: LearnerRank) -> None:
    """Wrap the collectives of ``torch.distributed`` and ``deepspeed.comm`` (which ZeRO calls,
    and which keeps its own references to torch's functions) to add up their wall time; a
    call made inside another timed call is not counted twice."""
    import time as _time

    import deepspeed.comm
    import deepspeed.comm.comm
    import torch.distributed as dist

    rank.collective_s = 0.0
    if getattr(dist, "_stppo_timed", False):
        return
    depth = [0]
    for module in (dist, deepspeed.comm, deepspeed.comm.comm):
        for name in _COLLECTIVES:
            fn = getattr(module, name, None)
            if fn is None or not callable(fn):
                continue

            def timed(*args, _fn=fn, **kwargs):
                if depth[0]:
                    return _fn(*args, **kwargs)
                depth[0] += 1
                started = _time.perf_counter()
                try:
                    work = _fn(*args, **kwargs)
                finally:
                    depth[0] -= 1
                    rank.collective_s += _time.perf_counter() - started
                asynchronous = kwargs.get("async_op") and hasattr(work, "wait")
                return _TimedWork(work, rank) if asynchronous else work

            setattr(module, name, timed)
    dist._stppo_timed = True


def _reset(rank: LearnerRank) -> None:
    rank.collective_s = 0.0


def _stats(rank: LearnerRank) -> dict[str, float]:
    import gc
    import resource

    gc.collect()
    with open("/proc/self/status") as status:
        rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
        "rss_gb": rss_kb / 1024**2,
        "collective_s": rank.collective_s,
    }


def run_config(model: Path, num_ranks: int, zero_stage: int, batch, args) -> dict:
    cls = ray.remote(LearnerRank).options(num_cpus=1, runtime_env=_actor_env())
    actors = [cls.remote(r, num_ranks) for r in range(num_ranks)]
    try:
        addr, port = ray.get(actors[0].rendezvous_address.remote())
        ray.get([a.join.remote(addr, port, 600.0) for a in actors])
        ray.get([a.execute.remote(_instrument) for a in actors])
        config = LearnerConfig(
            dtype="fp32",
            zero_stage=zero_stage,
            num_ranks=num_ranks,
            train_batch_size=len(batch),
            mini_batch_size=args.mini_batch_size,
            micro_batch_size=args.micro_batch_size,
            actor_lr=1e-5,
            critic_lr=1e-5,
        )
        algorithm = STPPOConfig(off_policy="behavior")
        ray.get([a.build.remote(str(model), config, algorithm, 0, 1.0) for a in actors])
        ray.get([a.call.remote("step", batch) for a in actors])  # warm-up
        ray.get([a.execute.remote(_reset) for a in actors])
        times, tokens_per_s = [], []
        for _ in range(args.steps):
            started = time.perf_counter()
            metrics = ray.get([a.call.remote("step", batch) for a in actors])[0]
            times.append(time.perf_counter() - started)
            tokens_per_s.append(metrics.tokens_per_s)
        stats = ray.get([a.execute.remote(_stats) for a in actors])
    finally:
        for a in actors:
            ray.kill(a)
    return {
        "num_ranks": num_ranks,
        "zero_stage": zero_stage,
        "step_s_median": statistics.median(times),
        "step_s": times,
        "tokens_per_s": statistics.median(tokens_per_s),
        "peak_rss_gb_per_rank": [s["peak_rss_gb"] for s in stats],
        "rss_after_steps_gb_per_rank": [s["rss_gb"] for s in stats],
        "collective_s_per_step_per_rank": [s["collective_s"] / args.steps for s in stats],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=Path("data/model/smollm2-135m-instruct"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--mini-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--turn-len", type=int, default=48)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    ray.init(num_cpus=max(args.ranks) + 1, include_dashboard=False, log_to_driver=False)
    batch = make_batch(args.trajectories, args.prompt_len, args.turns, args.turn_len, seed=0)
    num_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.tokenizer, Path(tmp) / "model", args.hidden, args.layers)
        for stage in args.stages:
            for ranks in args.ranks:
                result = run_config(model, ranks, stage, batch, args)
                results.append(result)
                print(json.dumps(result), flush=True)
    ray.shutdown()

    print(f"\nbatch: {len(batch)} trajectories, {num_tokens} tokens; model hidden "
          f"{args.hidden}, {args.layers} layers, fp32; {args.steps} measured steps\n")  # fmt: skip
    print("| ZeRO | ranks | step s (median) | tokens/s | peak RSS per rank (GB) "
          "| RSS after the steps per rank (GB) | collectives s/step per rank |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in results:
        rss = ", ".join(f"{v:.2f}" for v in r["peak_rss_gb_per_rank"])
        now = ", ".join(f"{v:.2f}" for v in r["rss_after_steps_gb_per_rank"])
        coll = ", ".join(f"{v:.2f}" for v in r["collective_s_per_step_per_rank"])
        print(f"| {r['zero_stage']} | {r['num_ranks']} | {r['step_s_median']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {rss} | {now} | {coll} |")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out),
                                        "tokenizer": str(args.tokenizer)}, "results": results},
                                       indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
