"""A CPU run prints no DeepSpeed accelerator WARNING: :func:`learner.distributed.import_deepspeed`
names the CPU accelerator where torch sees no CUDA device (DeepSpeed would pick it anyway,
with a warning a user has to wonder about)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
WARNING = "Setting accelerator to CPU"


def _stderr(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=300, check=True,
    )  # fmt: skip
    return done.stdout + done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is a no-CUDA one")
def test_deepspeed_on_cpu_without_the_accelerator_warning():
    assert WARNING in _stderr("import deepspeed")  # what a plain import prints here
    quiet = _stderr(
        "from learner.distributed import import_deepspeed\n"
        "ds = import_deepspeed()\n"
        "print(ds.get_accelerator().device_name())\n"
    )
    assert WARNING not in quiet and quiet.strip().endswith("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the variable is set only without CUDA")
def test_model_commands_name_the_cpu_accelerator_and_the_others_skip_torch():
    code = (
        "import os, sys\n"
        "sys.argv = ['stppo', {command!r}, '--help']\n"
        "from services.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('DS', os.environ.get('DS_ACCELERATOR'), 'torch' in sys.modules)\n"
    )
    assert _stderr(code.format(command="prepare")).strip().endswith("DS cpu True")
    assert _stderr(code.format(command="ctl")).strip().endswith("DS None False")
