"""HF engine generation throughput (:class:`actors.engines.hf.HFEngine`) on one device.

``--batch`` chat prompts, ``--new-tokens`` tokens each (temperature 1, no stop strings, EOS
ignored by the count: a random-init model rarely emits it), one warm-up batch, then
``--repeats`` timed batches; reports the median generated tokens/s and the peak GPU memory
allocated. ``--random-init`` builds random weights from ``--model``'s config and tokenizer
(``benchmarks/learner_step.py`` does the same), for a machine the weights cannot reach.
``scripts/gpu_smoke.sh --learner`` runs it on CUDA::

    python3 benchmarks/hf_engine.py --random-init --device cuda --out runs/bench/hf_engine.json

``--merge-contexts 300,900`` measures what continuous batching across rollout calls
(``rollout.calls_per_actor > 1``, :class:`actors.rollout.ContinuousBatcher`) asks of the
engine: call A (``--batch`` rows with about 300 tokens of context, a first turn) and call B
(``--batch`` rows with about 900, a third turn) generated one after the other, against one
merged call of both (left-padded to the longer context). Rounds interleave the two ways;
``merge_speedup`` = (seconds of A + seconds of B) / seconds of the merged call, medians
(above 1: the engine makes more tokens per busy second when two calls share a turn)::

    python3 benchmarks/hf_engine.py --random-init --merge-contexts 300,900 --batch 8 --out runs/bench/hf_merge.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.env import configure_local_caches

configure_local_caches()

import torch  # noqa: E402

from actors.engines.hf import HFEngine  # noqa: E402
from actors.engines.protocol import SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of the country whose largest airport is Jorge Chavez International?",
    "Who wrote the novel that the film Blade Runner is based on?",
    "Which river flows through the city where the Hagia Sophia stands?",
    "In which year did the first person to walk on the Moon return to Earth?",
]


def random_init_copy(model_dir: Path, seed: int) -> Path:
    """A bf16 model folder with ``model_dir``'s config and tokenizer and random weights."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    out = Path(tempfile.mkdtemp(prefix="bench-model-"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def chat_prompts(engine: HFEngine, batch: int) -> list[list[int]]:
    """``batch`` chat prompts (token ids, generation prompt added), cycling over QUESTIONS."""
    return [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            tokenize=True,
            add_generation_prompt=True,
        )["input_ids"]
        for i in range(batch)
    ]


def timed_generate(
    engine: HFEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, int]:
    """One ``engine.generate`` call: (wall seconds, CUDA synchronised before and after;
    tokens generated over all rows)."""
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(len(r.token_ids) for r in results)


PASSAGE = (
    "Doc 1 (Title: Lima) Lima is the capital and the largest city of Peru. It is located in "
    "the valleys of the Chillon, Rimac and Lurin rivers, in the central coastal part of the "
    "country, overlooking the Pacific Ocean. Jorge Chavez International Airport serves it. "
)


def context_prompts(engine: HFEngine, batch: int, tokens: int) -> list[list[int]]:
    """``batch`` prompts of ``tokens`` token ids each: a chat prompt (question, generation
    prompt) followed by retrieved-passage text, like a multi-turn context after a few turns.

    Raises:
        ValueError: ``tokens`` is shorter than the chat prompt itself.
    """
    filler = engine.tokenizer(PASSAGE * (tokens // 40 + 1), add_special_tokens=False)["input_ids"]
    prompts = []
    for chat in chat_prompts(engine, batch):
        if tokens < len(chat):
            raise ValueError(
                f"--merge-contexts {tokens} is shorter than the chat prompt ({len(chat)} tokens)"
            )
        prompts.append(chat + filler[: tokens - len(chat)])
    return prompts


def measure_merge(engine: HFEngine, params: SamplingParams, args: argparse.Namespace) -> dict:
    """Two calls one after the other vs the same two merged into one engine call.

    Returns the medians over ``args.repeats`` rounds (seconds, tokens/s) and
    ``merge_speedup`` = median(sequential seconds) / median(merged seconds).
    """
    short, long = (int(x) for x in args.merge_contexts.split(","))
    calls = {
        "a": context_prompts(engine, args.batch, short),
        "b": context_prompts(engine, args.batch, long),
    }
    calls["merged"] = calls["a"] + calls["b"]
    engine.generate(calls["merged"], params)  # warm-up at the largest shape
    seconds: dict[str, list[float]] = {k: [] for k in calls}
    tokens: dict[str, list[int]] = {k: [] for k in calls}
    for r in range(args.repeats):
        order = ["a", "b", "merged"] if r % 2 == 0 else ["merged", "a", "b"]
        for name in order:
            call_s, call_tokens = timed_generate(engine, calls[name], params)
            seconds[name].append(call_s)
            tokens[name].append(call_tokens)
    sequential = [a + b for a, b in zip(seconds["a"], seconds["b"], strict=True)]
    sequential_tokens = [a + b for a, b in zip(tokens["a"], tokens["b"], strict=True)]
    out = {
        "contexts": [short, long],
        "a_s": statistics.median(seconds["a"]),
        "b_s": statistics.median(seconds["b"]),
        "sequential_s": statistics.median(sequential),
        "merged_s": statistics.median(seconds["merged"]),
        "sequential_tokens_per_s": statistics.median(
            t / s for t, s in zip(sequential_tokens, sequential, strict=True)
        ),
        "merged_tokens_per_s": statistics.median(
            t / s for t, s in zip(tokens["merged"], seconds["merged"], strict=True)
        ),
        "seconds_all": seconds,
    }
    out["merge_speedup"] = out["sequential_s"] / out["merged_s"]
    print(
        f"  merge: A ({args.batch} x {short} ctx) {out['a_s']:.2f} s + B ({args.batch} x {long} ctx) "
        f"{out['b_s']:.2f} s = {out['sequential_s']:.2f} s; merged {out['merged_s']:.2f} s: "
        f"{out['merge_speedup']:.2f}x"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="data/model/smollm2-135m-instruct")
    parser.add_argument("--random-init", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--merge-contexts",
        default=None,
        metavar="SHORT,LONG",
        help="also time two calls of --batch rows (contexts of SHORT and LONG tokens) one after "
        "the other vs merged into one call",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = random_init_copy(Path(args.model), args.seed) if args.random_init else args.model
    engine = HFEngine(model, dtype=getattr(torch, args.dtype), device=args.device, seed=args.seed)
    prompts = chat_prompts(engine, args.batch)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, stop=(), seed=3)
    engine.generate(prompts, params)  # warm-up
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rates = []
    for _ in range(args.repeats):
        seconds, generated = timed_generate(engine, prompts, params)
        rates.append(generated / seconds)
    out = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": args.dtype,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "random_init": args.random_init,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_all": rates,
        "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
    }
    if args.merge_contexts:
        out["merge"] = measure_merge(engine, params, args)
    print(
        f"HF engine on {out['device']}: {out['tokens_per_s']:.0f} tokens/s "
        f"({args.batch} x {args.new_tokens} new tokens, {args.dtype}, median of {args.repeats})"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
