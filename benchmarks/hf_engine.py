"""HF engine generation throughput (:class:`actors.engines.hf.HFEngine`) on one device.

``--batch`` chat prompts, ``--new-tokens`` tokens each (temperature 1, no stop strings, EOS
ignored by the count: a random-init model rarely emits it), one warm-up batch, then
``--repeats`` timed batches; reports the median generated tokens/s and the peak GPU memory
allocated. ``--random-init`` builds random weights from ``--model``'s config and tokenizer
(``benchmarks/learner_step.py`` does the same), for a machine the weights cannot reach.
``scripts/gpu_smoke.sh --learner`` runs it on CUDA::

    python3 benchmarks/hf_engine.py --random-init --device cuda --out runs/bench/hf_engine.json
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = random_init_copy(Path(args.model), args.seed) if args.random_init else args.model
    engine = HFEngine(model, dtype=getattr(torch, args.dtype), device=args.device, seed=args.seed)
    prompts = [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            tokenize=True,
            add_generation_prompt=True,
        )["input_ids"]
        for i in range(args.batch)
    ]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, stop=(), seed=3)
    engine.generate(prompts, params)  # warm-up
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rates = []
    for _ in range(args.repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = engine.generate(prompts, params)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        rates.append(sum(len(r.token_ids) for r in results) / seconds)
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
    print(
        f"HF engine on {out['device']}: {out['tokens_per_s']:.0f} tokens/s "
        f"({args.batch} x {args.new_tokens} new tokens, {args.dtype}, median of {args.repeats})"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
