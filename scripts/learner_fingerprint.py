"""Fingerprint the learner's step on a tiny model: the metrics and weights of two steps per
configuration, to show a refactoring of ``learner/`` changed no computation.

Run it before and after a change and compare the two files; every number must be equal
bit for bit (timings are left out)::

    .venv/bin/python scripts/learner_fingerprint.py --out /tmp/before.json
    # ... change learner/ ...
    .venv/bin/python scripts/learner_fingerprint.py --out /tmp/after.json --compare /tmp/before.json

The model is a randomly initialised 2-layer Llama (hidden 64) with the committed SmolLM2
tokenizer, in float32 with ZeRO 0 on one CPU rank, seeded; the batches are drawn from a
seeded generator (two-turn trajectories with an environment span, groups of 2, behaviour
log-probs far from the model's so tokens clip). Compare files made on the same machine:
other CPUs round differently.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the product, and the tests' tiny models

CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (algorithm, learner overrides)
    "st_ppo": ({"variant": "st_ppo"}, {}),
    "st_ppo_packed": ({"variant": "st_ppo"}, {"pack_sequences": True}),
    "st_ppo_param_norm_loss_scale": (
        {"variant": "st_ppo", "bias_norm": "param", "scale_target": "loss"},
        {},
    ),
    "s_ppo_loss_scale": ({"variant": "s_ppo", "scale_target": "loss"}, {}),
    "turn_ppo_turn_mean": ({"variant": "turn_ppo", "turn_advantage": "turn_mean"}, {}),
    "ppo_decoupled": (
        {"variant": "ppo", "off_policy": "decoupled", "kl_mode": "loss", "entropy_coef": 0.01},
        {},
    ),
    "ppo_decoupled_loglinear_budget": (
        {"variant": "ppo", "off_policy": "decoupled", "proximal": "loglinear"},
        {"micro_batch_tokens": 40, "pack_sequences": True},
    ),
    "ppo_two_epochs": ({"variant": "ppo"}, {"ppo_epochs": 2, "mini_batch_size": 2}),
    "gspo": ({"variant": "gspo"}, {}),
    "cispo": ({"variant": "cispo"}, {}),
    "grpo": ({"variant": "grpo"}, {}),
    "so_grpo": ({"variant": "so_grpo"}, {}),
    "so_grpo_packed": ({"variant": "so_grpo"}, {"pack_sequences": True}),
}
"""Thirteen configurations: every variant, both objectives, the clip-bias pre-pass and the
parameter norm, packed and padded rows, a token budget, two epochs."""

TIMING = {"step_s", "tokens_per_s"}


def tiny_model(out: Path) -> Path:
    """Save the seeded tiny Llama and the committed tokenizer under ``out``."""
    import torch
    from tiny_models import save_model, tiny_llama_config
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok_dir = out / "tokenizer"
    tok_dir.mkdir(parents=True)
    for path in (ROOT / "tests/assets/smollm2-tokenizer").iterdir():
        if path.suffix == ".gz":
            (tok_dir / path.stem).write_bytes(gzip.decompress(path.read_bytes()))
        elif path.suffix != ".md":
            shutil.copy(path, tok_dir / path.name)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    return save_model(LlamaForCausalLM(tiny_llama_config(len(tok), tok)), tok, out / "model")


def batch(seed: int, num: int = 8) -> list[Any]:
    """``num`` two-turn trajectories of uneven lengths in groups of 2 (rewards 1, 0, ...)."""
    import numpy as np

    from actors.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        first, env, second = (int(rng.integers(lo, hi)) for lo, hi in ((1, 12), (0, 8), (1, 9)))
        mask = np.array([1] * first + [0] * env + [1] * second, dtype=np.int8)
        turn_ids = np.where(mask == 1, (np.arange(len(mask)) >= first + env).astype(np.int32), -1)
        out.append(
            Trajectory(
                prompt_ids=rng.integers(10, 1000, int(rng.integers(2, 10))),
                response_ids=rng.integers(10, 1000, len(mask)),
                loss_mask=mask,
                turn_ids=turn_ids.astype(np.int32),
                behavior_logprobs=(-rng.uniform(8.0, 13.0, len(mask)) * mask).astype(np.float32),
                reward=float(i % 2 == 0),
                success=i % 2 == 0,
                num_searches=1,
                num_turns=2,
                policy_version_min=0,
                policy_version_max=0,
                group_id=f"g{i // 2}",
                question_id=f"q{i // 2}",
                data_source="single_hop",
                finish_reason="answer",
            ).validate()
        )
    return out


def fingerprint(model_dir: Path, algorithm: dict[str, Any], overrides: dict[str, Any]) -> dict:
    """Two steps of a fresh learner: their metrics (timings left out) and the sha256 of
    every engine's parameters after them."""
    import torch
    from pydantic import TypeAdapter

    from learner.config import AlgorithmConfig, LearnerConfig
    from learner.trainer import Learner

    base = dict(
        dtype="fp32", zero_stage=0, train_batch_size=8, mini_batch_size=4, micro_batch_size=2,
        actor_lr=1e-3, critic_lr=1e-3,
    )  # fmt: skip
    algo = TypeAdapter(AlgorithmConfig).validate_python(algorithm)
    learner = Learner(model_dir, LearnerConfig(**{**base, **overrides}), algo, seed=0)
    steps = []
    for seed in (1, 2):
        metrics = learner.step(batch(seed)).to_dict()
        steps.append({k: v for k, v in metrics.items() if k not in TIMING})
    weights = {}
    for name in ("policy_engine", "critic_engine"):
        digest = hashlib.sha256()
        for pname, p in getattr(learner, name).module.named_parameters():
            digest.update(pname.encode())
            digest.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
        weights[name] = digest.hexdigest()
    return {"steps": steps, "weights": weights}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", type=Path, help="an earlier output; exit 1 on a difference")
    parser.add_argument("--only", nargs="*", help="configuration names (default: all)")
    args = parser.parse_args()
    import torch

    torch.use_deterministic_algorithms(True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(Path(tmp))
        for name, (algorithm, overrides) in CONFIGS.items():
            if args.only and name not in args.only:
                continue
            results[name] = fingerprint(model_dir, algorithm, overrides)
            print(f"{name}: {results[name]['weights']['policy_engine'][:16]}", flush=True)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())

    def same(a: Any, b: Any) -> bool:  # as written: NaN equals NaN, 0.1 is 0.1
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)

    differ = [n for n in results if not same(results[n], before.get(n))]
    for name in differ:
        old, new = before.get(name, {}), results[name]
        for i, (a, b) in enumerate(zip(old.get("steps", []), new["steps"], strict=False)):
            keys = sorted(k for k in set(a) | set(b) if not same(a.get(k), b.get(k)))
            print(f"DIFFERS {name} step {i + 1}: " + ", ".join(
                f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:6]))  # fmt: skip
        if not same(old.get("weights"), new["weights"]):
            print(f"DIFFERS {name}: weights")
    print(f"{len(results) - len(differ)} of {len(results)} configurations equal bit for bit")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
