"""The learner's micro-batch loop does not make the host wait for the GPU.

A host read of a CUDA tensor (``.item()``, ``float()``, ``bool()``) or a blocking copy to
the GPU waits for every kernel queued before it; one per metric and micro-batch kept the
host from preparing the next micro-batch while the GPU ran the last one's backward. The
step's metrics are now read once per optimizer step (:class:`DeferredReads`) and host
tensors go up without a wait (:func:`learner.batch.to_device`). Checked on the CPU with
:class:`host_syncs.SimulatedDevice` (benchmarks/host_syncs.py) (the CPU twin of ``torch.cuda.set_sync_debug_mode``),
and on CUDA by ``tests/gpu/test_learner_cuda.py``.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter

import pytest
import torch
from host_syncs import SimulatedDevice
from learner_factories import make_tiny_learner, make_uneven_batch

from learner.batch import to_device
from learner.config import PPOConfig, SOGRPOConfig, STPPOConfig
from learner.step_metrics import DeferredReads, read_scalars


def test_read_scalars_is_float_of_item_exactly():
    values = [
        torch.tensor(0.1, dtype=torch.float32),
        torch.tensor([2**40 + 1]),
        torch.tensor(True),
        None,
        2.5,
        torch.tensor(-math.inf),
    ]
    got = read_scalars(values)
    assert got[:3] == [float(values[0].item()), float(2**40 + 1), 1.0]
    assert math.isnan(got[3]) and got[4:] == [2.5, -math.inf]


def test_deferred_reads_fill_on_flush_and_call_back_in_order():
    reads, calls = DeferredReads(), []
    first = reads.defer({"a": torch.tensor(1.5), "b": 2}, lambda v: calls.append(("first", v)))
    second = reads.defer({"c": torch.tensor(3)}, lambda v: calls.append(("second", v)))
    with pytest.raises(RuntimeError, match="before the flush"):
        first.get()
    reads.flush()
    assert first.get() == {"a": 1.5, "b": 2.0} and second.get() == {"c": 3.0}
    assert calls == [("first", {"a": 1.5, "b": 2.0}), ("second", {"c": 3.0})]
    reads.flush()  # nothing queued: nothing read, nothing called again
    assert len(calls) == 2


def test_simulated_device_flags_reads_of_device_tensors_and_blocking_uploads():
    weight = torch.nn.Linear(2, 2)
    host = torch.ones(2)
    with SimulatedDevice([weight]) as sim:
        float(host.sum())  # a host tensor: free
        out = weight(host)  # computed from a resident parameter: resident
        out.sum().item()
        uploaded = host.to("cpu")  # blocking
        bool(uploaded.any())
        to_device(host, "cpu").sum()  # non-blocking: no sync
    kinds = Counter(site.split()[-1] for site in sim.syncs.elements())
    assert kinds == Counter({"item": 1, "(to)": 1, "__bool__": 1})


def _syncs_by_file(sim: SimulatedDevice, everywhere: bool) -> Counter[tuple[str, str]]:
    """(file, kind) -> count of the syncs, placed at their innermost frame: this project's
    code only (not transformers' or DeepSpeed's, which it calls), or ``everywhere``. A site
    reads ``file:line [<- file:line] kind``, the library's frame first."""
    out: Counter[tuple[str, str]] = Counter()
    for site, count in sim.syncs.items():
        if everywhere or " <- " not in site:
            where = site.split(" ", 1)[0]
            kind = site.rsplit(" <- ", 1)[-1].split(" ", 1)[1]
            out[(where.rsplit(":", 1)[0], kind)] += count
    return out


def _step_syncs(
    tiny_llama_dir,
    algorithm,
    micro: int,
    sft: bool = False,
    everywhere: bool = False,
    **overrides,
) -> Counter[tuple[str, str]]:
    """This project's syncs (``everywhere``: all of them) in one RL step (``sft``: one SFT
    step) after a warm-up step."""
    learner = make_tiny_learner(
        tiny_llama_dir,
        algorithm,
        train_batch_size=8,
        mini_batch_size=4,
        micro_batch_size=micro,
        **overrides,
    )
    step = learner.supervised_step if sft else learner.step
    step(make_uneven_batch(0, 8))
    with SimulatedDevice(learner.engines) as sim:
        step(make_uneven_batch(1, 8))
    return _syncs_by_file(sim, everywhere)


@pytest.mark.parametrize(
    ("algorithm", "overrides"),
    [
        (STPPOConfig(), {"dtype": "bf16", "zero_stage": 2}),
        (STPPOConfig(), {"pack_sequences": True}),
        (PPOConfig(off_policy="decoupled", proximal="loglinear"), {"pack_sequences": True}),
        (SOGRPOConfig(), {}),
    ],
    ids=["st_ppo-bf16-zero2", "st_ppo-packed", "ppo-decoupled-loglinear", "so_grpo"],
)
def test_micro_batches_add_no_host_sync_in_our_code(tiny_llama_dir, algorithm, overrides):
    """Eight micro-batches per step against two, the same optimizer steps: the six more
    micro-batches add no sync in this project's code (the policy tokens' positions come
    from the host, the loss skips its value checks; transformers' mask checks at a forward's
    start are its own); nothing in the step uploads a host tensor with a blocking copy."""
    many = _step_syncs(tiny_llama_dir, algorithm, 1, **overrides)
    few = _step_syncs(tiny_llama_dir, algorithm, 4, **overrides)
    added = {site: many[site] - few[site] for site in many if many[site] > few[site]}
    assert not added, added
    assert not [site for site in many if site[1].startswith("blocking upload")], many


@pytest.mark.parametrize("algorithm", [STPPOConfig(), SOGRPOConfig()], ids=["st_ppo", "so_grpo"])
@pytest.mark.parametrize("packed_attention", ["mask", "varlen"])
def test_packed_micro_batches_add_no_host_sync_at_all(tiny_llama_dir, algorithm, packed_attention):
    """In the packed layouts the attention mask comes prepared from the host-known layout
    (``learner.packing.ModelInputs``), so transformers does not read the positions at each
    forward's start to look for packed rows: eight micro-batches against two add no sync
    anywhere, transformers' and DeepSpeed's included. Varlen on the CPU runs the kernel's
    twin, whose loop over the segments reads their bounds (``segment_attention``; the CUDA
    kernel takes them on the device): that read is the one it may add."""
    overrides = {"pack_sequences": True, "packed_attention": packed_attention}
    many = _step_syncs(tiny_llama_dir, algorithm, 1, everywhere=True, **overrides)
    few = _step_syncs(tiny_llama_dir, algorithm, 4, everywhere=True, **overrides)
    added = {site: many[site] - few[site] for site in many if many[site] > few[site]}
    if packed_attention == "varlen":
        assert added.pop(("learner/attention.py", "tolist"), 0) > 0  # the CPU twin's reads
    assert not added, added


def test_sft_micro_batches_add_no_host_sync(tiny_llama_dir):
    """The warm start's SFT step reads its micro-batches' losses once, after the loop."""
    many = _step_syncs(tiny_llama_dir, STPPOConfig(), 1, sft=True)
    few = _step_syncs(tiny_llama_dir, STPPOConfig(), 4, sft=True)
    added = {site: many[site] - few[site] for site in many if many[site] > few[site]}
    assert not added, added


class _PlainEngine:
    """``engine.backward`` as DeepSpeed's, for a plain module."""

    @staticmethod
    def backward(loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        loss.backward()


@pytest.mark.parametrize("finite", [True, False])
def test_nonfinite_loss_poisons_every_gradient_without_a_host_read(finite):
    """A NaN that reaches no gradient (here a constant added to the loss) still makes every
    gradient NaN, so the optimizer step's overflow check skips it; a finite loss's
    gradients are the plain backward's, bit for bit. Decided on the device: no sync."""
    from learner.engines import backward

    torch.manual_seed(0)
    model, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    constant = torch.tensor(0.0 if finite else math.nan)
    output = model(x)
    with SimulatedDevice([model]) as sim:
        backward(_PlainEngine(), output.square().sum() + constant, output)
    assert sim.total == 0
    grads = [p.grad.clone() for p in model.parameters()]
    if not finite:
        assert all(torch.isnan(g).all() for g in grads)
        return
    model.zero_grad()
    model(x).square().sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


@pytest.mark.parametrize(("dtype", "zero_stage"), [("bf16", 2), ("fp32", 0), ("bf16", 3)])
def test_deepspeed_does_not_synchronise_the_device_in_a_step(
    tiny_llama_dir, monkeypatch, dtype, zero_stage
):
    """DeepSpeed's throughput timer, on by default, synchronises the whole device at engine
    forwards and optimizer steps (16 times in this step); the learner turns it off."""
    from deepspeed.accelerator import get_accelerator

    learner = make_tiny_learner(
        tiny_llama_dir,
        STPPOConfig(),
        dtype=dtype,
        zero_stage=zero_stage,
        train_batch_size=8,
        mini_batch_size=4,
        micro_batch_size=2,
    )
    for seed in (0, 1):  # the timer starts timing at its third step
        learner.step(make_uneven_batch(seed, 8))
    accelerator, calls = get_accelerator(), []
    synchronize = type(accelerator).synchronize
    monkeypatch.setattr(
        type(accelerator),
        "synchronize",
        lambda self, device_index=None: calls.append(1) or synchronize(self, device_index),
    )
    learner.step(make_uneven_batch(2, 8))
    assert not calls


def test_count_syncs_on_cuda_reads_pytorchs_sync_warnings_by_site(monkeypatch):
    """On CUDA the count is PyTorch's own (``set_sync_debug_mode("warn")``, switched off
    again after the call); each warning is placed at this project's file or the library's,
    and other warnings are not counted. The warnings are written here: no GPU needed."""
    from pathlib import Path

    import host_syncs

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    root = Path(host_syncs.__file__).resolve().parents[1]
    library = "/venv/lib/python3.12/site-packages/transformers/masking_utils.py"

    def call():
        for filename, line in [(root / "learner/logprobs.py", 265), (library, 757)] * 2:
            message = "called a synchronizing CUDA operation"
            warnings.warn_explicit(message, UserWarning, str(filename), line)
        warnings.warn("not a sync", stacklevel=1)

    counted = host_syncs.count_syncs(call, [], torch.device("cuda"))
    assert counted == Counter(
        {"learner/logprobs.py:265": 2, "transformers/masking_utils.py:757": 2}
    )
    assert modes == ["warn", "default"]
