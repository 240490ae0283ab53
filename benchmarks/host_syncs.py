"""Where code makes the host wait for a GPU: counted on CUDA, and found on the CPU.

``torch.cuda.set_sync_debug_mode`` reports every synchronising CUDA call, but only on a
GPU. :class:`SimulatedDevice` is its CPU twin: a ``TorchFunctionMode`` that
tracks which tensors would live on the accelerator ("resident": the parameters and buffers
of the modules it is given, what a ``.to(...)`` uploads, and everything computed from a
resident tensor) and records, with the line of code that did it:

- **reads** of a resident tensor by the host (``item``, ``float``, ``int``, ``bool``,
  ``tolist``, ``numpy``, ``cpu``) and the operations whose output size depends on a
  resident tensor's values (``nonzero``, ``masked_select``, ``unique``, indexing with a
  resident boolean mask): on CUDA each waits for every kernel queued before it;
- **blocking uploads**: a host tensor copied to the device by ``.to(...)`` without
  ``non_blocking=True``, or ``torch.tensor``/``torch.as_tensor`` with a ``device``: PyTorch's
  blocking copy synchronises the stream (:func:`learner.batch.to_device` is the way
  around).

Conventions (what a CPU run cannot tell): ``.to(...)`` of a resident tensor stays on the
device (downloads are ``.cpu()``, ``.tolist()``, ``.item()``...); tensors made by factory
functions (``zeros``, ``arange``...) are host tensors until combined with a resident one;
gradients made by autograd's engine are not seen.

:func:`count_syncs` counts one call's syncs either way (CUDA's own report on a GPU);
``tests/unit/learner/test_host_syncs.py`` and ``benchmarks/learner_step.py --count-syncs`` use it.
"""

from __future__ import annotations

import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_READS = {"item", "__float__", "__int__", "__index__", "__bool__", "tolist", "numpy", "cpu"}
_VALUE_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
_UPLOAD_FACTORIES = {"tensor", "as_tensor"}
_PROJECT = Path(__file__).resolve().parents[1]


def _site(filename: str, lineno: int) -> str | None:
    """``file:line`` relative to this project (outside tests/) or to site-packages; None for
    a frame of neither (this module, tests, scripts) and for torch's own Python (the
    operation's implementation, not its caller)."""
    path = Path(filename).resolve()
    if path == Path(__file__).resolve() or "site-packages/torch/" in path.as_posix():
        return None
    if "site-packages" in path.parts:
        parts = path.parts
        return f"{'/'.join(parts[parts.index('site-packages') + 1 :])}:{lineno}"
    if path.is_relative_to(_PROJECT) and not path.is_relative_to(_PROJECT / "tests"):
        return f"{path.relative_to(_PROJECT)}:{lineno}"
    return None


def _where() -> str:
    """Where the sync happens: ``file:line`` of the innermost frame of this project's code
    (outside tests/), preceded by ``library/file.py:line <- `` when the innermost frame
    of all is a library's (transformers, DeepSpeed, torch) called from there."""
    library = None
    for frame in reversed(traceback.extract_stack()):
        site = _site(frame.filename, frame.lineno or 0)
        if site is None:
            continue
        if "site-packages" in frame.filename:
            library = library or site
            continue
        return site if library is None else f"{library} <- {site}"
    return library or "?"


class SimulatedDevice(TorchFunctionMode):
    """Counts would-be host syncs (module docstring) while active.

    Args:
        modules: whose parameters and buffers are resident from the start.

    Attributes:
        syncs: ``Counter`` of ``"file:line kind"`` -> count, where kind is the operation.
    """

    def __init__(self, modules: Iterable[torch.nn.Module] = ()) -> None:
        super().__init__()
        self._resident: dict[int, weakref.ref] = {}
        self.syncs: Counter[str] = Counter()
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                self._mark(tensor)

    @property
    def total(self) -> int:
        """Syncs recorded so far."""
        return sum(self.syncs.values())

    def resident(self, tensor: Any) -> bool:
        """Whether ``tensor`` is a tensor that would live on the device."""
        ref = self._resident.get(id(tensor))
        return ref is not None and ref() is tensor

    def _mark(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self._resident[key] = weakref.ref(tensor, lambda _, key=key: self._resident.pop(key, 0))

    def _record(self, kind: str) -> None:
        self.syncs[f"{_where()} {kind}"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(self.resident(t) for t in tensors)
        out = func(*args, **kwargs)
        if name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor):
            source = args[0]
            if self.resident(source):
                on_device = True
            elif name == "cuda" or self._names_device(args[1:], kwargs):  # an upload
                if not kwargs.get("non_blocking", False):
                    self._record(f"blocking upload ({name})")
                if out is source:  # on the CPU, .to(cpu) is the tensor itself: keep apart
                    out = source.clone()
                on_device = True
        elif name in _UPLOAD_FACTORIES and kwargs.get("device") is not None:
            self._record(f"blocking upload (torch.{name})")
            on_device = True
        elif on_device and name in _READS and self.resident(args[0]):
            self._record(name)
            return out if name != "cpu" else out.clone()  # the host copy is not resident
        elif on_device and name in _VALUE_SHAPED:
            self._record(name)
        elif name == "__getitem__" and any(
            self.resident(t) and t.dtype == torch.bool for t in tensors[1:]
        ):
            self._record("boolean-mask index")
        if on_device:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out

    @staticmethod
    def _names_device(args: tuple, kwargs: dict) -> bool:
        """Whether a ``.to(...)`` call names a device (not only a dtype)."""
        candidates = [*args, kwargs.get("device")]
        return any(isinstance(a, (str, torch.device)) for a in candidates if a is not None)


def count_syncs(
    call: Callable[[], object], modules: Iterable[torch.nn.Module], device: torch.device
) -> Counter[str]:
    """The host syncs of one ``call()``, by where they happen.

    Args:
        call: what to count (e.g. one learner step).
        modules: the models on ``device`` (their parameters are resident on the CPU).
        device: where they run. On CUDA, the synchronising calls PyTorch itself reports
            (``torch.cuda.set_sync_debug_mode("warn")``; the site is the Python line that
            called the operation: ``learner/...`` for this project's code, the library's
            path for transformers' or DeepSpeed's); elsewhere those :class:`SimulatedDevice`
            finds.

    Returns:
        ``Counter`` of site -> syncs (``sum(...values())`` is the total).
    """
    if device.type != "cuda":
        with SimulatedDevice(modules) as sim:
            call()
        return sim.syncs
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return Counter(
        _site(w.filename, w.lineno) or f"{w.filename}:{w.lineno}"
        for w in caught
        if "synchronizing" in str(w.message)
    )
