"""fp32 vs bf16 matmul on this CPU, side by side: is ``dtype = "auto"`` right here?

One 512x576 @ 576x1536 matmul (a SmolLM2-135M MLP projection over a 512-token batch) on one
thread, median of repeats, both dtypes in the same run; prints the CPU, its bf16 flags,
what ``dtype = "auto"`` resolves to and the measured ratio.

    .venv/bin/python benchmarks/cpu_dtype.py
"""

from __future__ import annotations

import statistics
import time

import torch

from actors.hardware import cpu_flags, resolve_dtype


def median_ms(dtype: torch.dtype, repeats: int = 30) -> float:
    """Median wall milliseconds of one [512, 576] @ [576, 1536] matmul in ``dtype``."""
    a = torch.randn(512, 576).to(dtype)
    b = torch.randn(576, 1536).to(dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    model, flags = cpu_flags()
    fp32, bf16 = median_ms(torch.float32), median_ms(torch.bfloat16)
    bf16_flags = sorted(f for f in flags if "bf16" in f)
    print(f"cpu: {model}; bf16 flags: {bf16_flags or 'none'}")
    print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    print(f"fp32 {fp32:.2f} ms, bf16 {bf16:.2f} ms: bf16 is {fp32 / bf16:.2f}x fp32's speed")
    choice = resolve_dtype("auto")
    print(f"dtype = 'auto' -> {choice.name} ({choice.reason})")


if __name__ == "__main__":
    main()
