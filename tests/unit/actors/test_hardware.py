"""``dtype = "auto"``: bf16 where the hardware multiplies it natively, fp32 elsewhere."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from actors.hardware import (
    AVX2_EMULATION_ENV,
    FORCE_ENV,
    ISA_ENV,
    apply_cpu_isa_emulation,
    cpu_flags,
    cpu_has_native_bf16,
    resolve_dtype,
)
from learner.engines import deepspeed_config

pytestmark = pytest.mark.cpu_isa  # make test-avx2 runs it as an AVX2-only CPU

# /proc/cpuinfo excerpts of the CPUs this project runs on

AVX2_EPYC = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2
"""
AVX512_BF16_EPYC = """processor\t: 0
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni
"""
AMX_XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("cpuinfo", "native", "flag"),
    [
        (AVX2_EPYC, False, None),
        (AVX512_BF16_EPYC, True, "avx512_bf16"),
        (AMX_XEON, True, "amx_bf16"),
    ],
)
def test_detection_reads_the_cpu_flags(tmp_path, monkeypatch, cpuinfo, native, flag):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    monkeypatch.delenv(ISA_ENV, raising=False)
    got, why = cpu_has_native_bf16(write(tmp_path, cpuinfo))
    assert got is native
    assert cpu_flags(write(tmp_path, cpuinfo))[0] in why
    if flag:
        assert flag in why


def test_missing_cpuinfo_means_no_native_bf16(tmp_path, monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert cpu_has_native_bf16(tmp_path / "absent")[0] is False


@pytest.mark.parametrize(("forced", "name"), [("1", "bf16"), ("0", "fp32")])
def test_auto_follows_the_forced_detection_on_cpu(monkeypatch, forced, name):
    monkeypatch.setenv(FORCE_ENV, forced)
    choice = resolve_dtype("auto", "cpu")
    assert choice.name == name and FORCE_ENV in choice.reason
    # the learner's DeepSpeed config follows the same choice
    from learner.config import LearnerConfig

    ds = deepspeed_config(LearnerConfig(dtype="auto"), 1e-5, with_optimizer=True)
    assert ds["bf16"]["enabled"] is (name == "bf16")


def test_auto_is_bf16_on_cuda_and_explicit_values_pass_through(monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "0")
    assert resolve_dtype("auto", "cuda").name == "bf16"
    assert resolve_dtype("fp32", "cuda").name == "fp32"
    assert resolve_dtype("bf16", "cpu").name == "bf16"


def test_bad_values_fail_clearly(monkeypatch):
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("fp16")
    monkeypatch.setenv(FORCE_ENV, "yes")
    with pytest.raises(ValueError, match=FORCE_ENV):
        resolve_dtype("auto", "cpu")


# ----------------------------------------------- running as an AVX2-only CPU (STPPO_CPU_ISA)


@pytest.mark.parametrize("cpuinfo", [AVX512_BF16_EPYC, AMX_XEON])
def test_avx2_emulation_hides_the_avx512_and_amx_flags(tmp_path, monkeypatch, cpuinfo):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    monkeypatch.setenv(ISA_ENV, "avx2")
    model, flags = cpu_flags(write(tmp_path, cpuinfo))
    assert "avx2" in flags and not any(f.startswith(("avx512", "amx")) for f in flags)
    native, why = cpu_has_native_bf16(write(tmp_path, cpuinfo))
    assert native is False and f"{ISA_ENV}=avx2" in why and model in why
    monkeypatch.setenv(ISA_ENV, "avx512")
    with pytest.raises(ValueError, match=ISA_ENV):
        cpu_flags(write(tmp_path, cpuinfo))


def test_avx2_emulation_needs_the_libraries_switches_and_then_patches_torch(monkeypatch):
    import torch.cpu

    monkeypatch.delenv(ISA_ENV, raising=False)
    assert apply_cpu_isa_emulation() is False  # off without the variable
    for name in [n for n in dir(torch.cpu) if n.startswith("_is_")]:
        monkeypatch.setattr(torch.cpu, name, getattr(torch.cpu, name))  # restored after
    for key in AVX2_EMULATION_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(ISA_ENV, "avx2")
    with pytest.raises(RuntimeError, match="ATEN_CPU_CAPABILITY=avx2") as err:
        apply_cpu_isa_emulation()  # torch read its own switches at start-up: too late now
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in str(err.value) and "scripts/as_avx2.sh" in str(err.value)
    for key, value in AVX2_EMULATION_ENV.items():
        monkeypatch.setenv(key, value)
    assert apply_cpu_isa_emulation() is True
    assert not torch.cpu._is_avx512_supported() and not torch.cpu._is_avx512_bf16_supported()
    assert not torch.cpu._is_amx_tile_supported() and not torch.cpu._is_vnni_supported()


def test_as_avx2_script_sets_the_emulation_environment():
    from services.env import PROJECT_ROOT

    out = subprocess.run(
        [str(PROJECT_ROOT / "scripts" / "as_avx2.sh"), "env"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ["PATH"]},
    ).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert {k: env.get(k) for k in AVX2_EMULATION_ENV} == AVX2_EMULATION_ENV


def test_gpus_given_and_unusable_stop_the_process_naming_the_versions(monkeypatch, tmp_path):
    """A rollout actor or learner rank given GPUs by Ray (``CUDA_VISIBLE_DEVICES``) that
    torch cannot use stops, instead of running on the CPU."""
    import torch

    from actors import hardware

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    hardware.check_visible_gpus("rollout actor")  # no GPU given: nothing to check
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(hardware.GPUUnavailableError, match=r"GPU\(s\) 2,3 .* is a CPU build"):
        hardware.check_visible_gpus("rollout actor")
    version = tmp_path / "version"
    version.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
    )
    monkeypatch.setattr(hardware, "NVIDIA_DRIVER_VERSION_FILE", version)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(hardware.GPUUnavailableError) as stopped:
        hardware.check_visible_gpus("learner rank 0")
    assert "built for CUDA 13.0 and the NVIDIA driver is 535.104.05" in str(stopped.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    hardware.check_visible_gpus("learner rank 0")  # usable: nothing to say
