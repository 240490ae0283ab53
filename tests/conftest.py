"""Shared fixtures. Tests run against the assets built by ``stppo prepare`` (the README test
command builds them first); a missing asset is an error naming the command, not a skip.

No silent skips: a skipped test *fails* unless it is GPU-only (under ``tests/gpu/`` or
marked ``gpu``; skipped by name when there is no CUDA device) or its skip reason falls in
a category listed in ``STPPO_ALLOW_SKIP`` (comma-separated, e.g. ``STPPO_ALLOW_SKIP=vllm``):

- ``prometheus``: the Prometheus / promtool binaries are missing;
- ``vllm``: the ``vllm`` package is not importable (or, for the reverse test, it is);
- ``kubectl`` / ``wget``: those command-line tools are missing;
- ``netns``: network namespaces cannot be made (not root, no iproute2): the tests that
  cross a network (``deploy/local_cluster/netns.py``).
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

import pytest

from actors.hardware import apply_cpu_isa_emulation, cpu_has_native_bf16
from services.env import PROJECT_ROOT, configure_local_caches

configure_local_caches()
# STPPO_CPU_ISA=avx2 (scripts/as_avx2.sh): torch's feature queries answer as an AVX2-only
# CPU's before any test imports vLLM, whose kernel choice reads them
apply_cpu_isa_emulation()


def pytest_report_header(config: pytest.Config) -> str:
    """The CPU the suite runs as: dtype expectations and kernels follow it."""
    import torch

    _, why = cpu_has_native_bf16()
    return f"cpu: {why}; torch kernels {torch.backends.cpu.get_cpu_capability()}"


DATA_DIR = Path(os.environ.get("STPPO_DATA_DIR", PROJECT_ROOT / "data"))
TOKENIZER_ASSET = Path(__file__).parent / "assets" / "smollm2-tokenizer"
UNIT_TEST_TIMEOUT_S = 60
"""Each unit test's limit (pytest-timeout; the suite's default, 900 s, is for integration
tests): the slowest unit test takes about 11 s on a 2-core CPU."""
MODEL_DIR = DATA_DIR / "model" / "smollm2-135m-instruct"


ALLOW_SKIP_ENV = "STPPO_ALLOW_SKIP"
SKIP_CATEGORIES: dict[str, tuple[str, ...]] = {
    "prometheus": ("prometheus", "promtool"),
    "vllm": ("vllm",),
    "kubectl": ("kubectl",),
    "wget": ("wget",),
    "netns": ("netns:",),
}


def skip_category(reason: str) -> str | None:
    """The :data:`SKIP_CATEGORIES` key whose keyword appears in ``reason`` (None if none)."""
    low = reason.lower()
    return next((c for c, words in SKIP_CATEGORIES.items() if any(w in low for w in words)), None)


def skip_allowed(nodeid: str, is_gpu: bool, reason: str, allow: str) -> bool:
    """May this skip stand? GPU-only tests always; others only by an allowed category."""
    if is_gpu or nodeid.startswith("tests/gpu/"):
        return True
    allowed = {c.strip() for c in allow.split(",") if c.strip()}
    return skip_category(reason) in allowed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    is_gpu = item.get_closest_marker("gpu") is not None
    if skip_allowed(item.nodeid, is_gpu, reason, os.environ.get(ALLOW_SKIP_ENV, "")):
        return
    category = skip_category(reason) or "<none: fix the test or its environment>"
    report.outcome = "failed"
    report.longrepr = (
        f"skipped without permission: {reason}\n"
        f"(no silent skips; to allow this one set {ALLOW_SKIP_ENV}={category}, see README)"
    )


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"{path} is missing: run `stppo prepare` (the README test command does)")
    return path


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The real SmolLM2-135M-Instruct folder (bf16 safetensors + tokenizer)."""
    return _require(MODEL_DIR)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The built data folder (corpus, QA sets, indexes)."""
    return _require(DATA_DIR)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct's tokenizer (49,152 tokens and its chat template), committed
    under ``tests/assets/`` (``tokenizer.json`` gzipped): tests that need only the tokenizer
    run without ``stppo prepare`` and without the network."""
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    for path in TOKENIZER_ASSET.iterdir():
        if path.suffix == ".gz":
            (out / path.stem).write_bytes(gzip.decompress(path.read_bytes()))
        elif path.suffix != ".md":
            shutil.copy(path, out / path.name)
    return out


@pytest.fixture(scope="session")
def tok(tokenizer_dir: Path):
    """The SmolLM2 tokenizer (:func:`tokenizer_dir`) as a transformers tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tok) -> Path:
    """A randomly initialised 2-layer Llama (hidden 64) with SmolLM2's tokenizer, saved as
    an HF folder. Fast stand-in for the real policy where weights do not matter."""
    import torch
    from tiny_models import save_model, tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(tok), tok)).to(torch.bfloat16)
    return save_model(model, tok, tmp_path_factory.mktemp("tiny_llama"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests that start vLLM engines in this process first, and give every unit
    test without its own limit :data:`UNIT_TEST_TIMEOUT_S`.

    vLLM 0.32's Triton kernel dispatcher (``vllm/triton_utils/dispatcher.py``,
    ``_rebind_kernels``) scans every module in ``sys.modules`` when an engine starts and
    reads ``vars(value).get(...)`` of module attributes. Once llvmlite's shared library is
    loaded (numba, imported by earlier tests in the same process), ``llvmlite.binding.ffi.lib``
    answers any attribute, ``__dict__`` included, with a function wrapper, and the scan dies
    with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``. Rollout actors
    never hit it (an engine starts in a fresh process); a test session that starts engines
    in-process must start them before anything loads llvmlite.
    """
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)  # stable
    unit = PROJECT_ROOT / "tests" / "unit"
    for item in items:
        if item.path.is_relative_to(unit) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TEST_TIMEOUT_S))
