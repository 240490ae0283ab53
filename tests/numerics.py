"""How close two computations of the same float32 gradient must be, on any CPU.

Two float32 computations of one gradient differ when their sums run in another order: other
micro-batches, another attention layout, another SIMD width (an AVX2-only CPU adds 8 lanes
at a time, AVX-512 16, and oneDNN and MKL pick their blocking by the instruction set). The
tolerance is therefore derived from the float32 unit roundoff and the length of the longest
reduction, not measured on one machine.

Rounding model (N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
2002, section 4.2; the probabilistic form in Higham and Mary, SIAM J. Sci. Comput. 41(5),
2019): a sum of ``n`` float32 terms, in any order, is off the exact sum by at most
``n * u`` times the sum of the terms' magnitudes, and by about ``sqrt(n) * u`` times it when
the roundings are independent, which is what a change of order gives (``u = 2**-24``).
A gradient ends a chain of such sums; the longest one bounds the error: in a language
model, the log-softmax normaliser over the vocabulary and its backward (``n = V``). Elements
of a gradient are often small differences of large terms, so the magnitude that counts is
the tensor's largest ``|g|``, not the element's own; a factor 2 covers the two passes
(forward normaliser, backward) over that length. Per tensor, against the exact gradient:

    atol = 2 * sqrt(V) * u * max|g|        (rtol = 0)

SmolLM2's vocabulary (V = 49,152): ``2.6e-5 * max|g|``. Two float32 computations compared
with each other are each within it of the exact value, so they get twice that.
"""

from __future__ import annotations

import math

import torch

UNIT_ROUNDOFF_FP32 = torch.finfo(torch.float32).eps / 2
"""``u = 2**-24``: one float32 rounding is off by at most ``u`` relative."""


def fp32_gradient_atol(grad_max: float, reduction_length: int, computations: int = 1) -> float:
    """Absolute tolerance for a float32 gradient tensor (module docstring).

    Args:
        grad_max: the tensor's largest ``|g|`` (of the exact, or the reference, gradient).
        reduction_length: the longest sum in the chain (the vocabulary size for an LM).
        computations: 1 against the exact (float64) gradient, 2 between two float32 ones.
    """
    return computations * 2.0 * math.sqrt(reduction_length) * UNIT_ROUNDOFF_FP32 * grad_max


def assert_gradients_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    reduction_length: int,
    computations: int = 1,
) -> None:
    """Every tensor of ``got`` within :func:`fp32_gradient_atol` of ``want``'s (same names).

    Raises:
        AssertionError: names differ, or a tensor is off; the message names the tensor, its
            largest ``|g|`` and the tolerance.
    """
    assert got.keys() == want.keys()
    for name, exact in want.items():
        grad_max = float(exact.abs().max())
        atol = fp32_gradient_atol(grad_max, reduction_length, computations)
        torch.testing.assert_close(
            got[name].to(exact.dtype),
            exact,
            rtol=0.0,
            atol=atol,
            msg=lambda m, name=name, g=grad_max, a=atol: (
                f"{name} (max |g| {g:.3g}, atol {a:.3g}): {m}"
            ),
        )
