"""An engine loads a weight broadcast tensor by tensor, never holding a second copy.

A real weight-sync group (:class:`actors.weight_group.WeightGroup`, gloo on loopback): its
rank 0 broadcasts new weights, its rank 1 receives them into a real
:class:`actors.engines.hf.HFEngine` as the rollout worker does (``receive`` then the
engine's ``load_weights`` on the stream). The receiving side's resident memory is sampled
every millisecond: streamed, it grows by at most 1.5 times the largest tensor; collected
into a dict first (how the worker received before), by the whole model, which the same
measurement sees (so the test can fail). Both members run in one child process started
with ``MALLOC_MMAP_THRESHOLD_`` fixed, so that a freed receive buffer leaves the resident
set at once (``tests/integration/test_zero3_ranks.py`` explains why).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_during(fn) -> int:
    """Peak resident bytes during ``fn()`` over those before it."""
    baseline = _resident()
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _resident())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return peak[0] - baseline


def _receive_twice(folder: str, out: multiprocessing.Queue) -> None:
    """The child: two broadcasts of new weights into an HF engine, streamed then as a
    dict; puts ``(streamed peak, dict peak, model bytes, largest tensor bytes, loaded ok)``."""
    import torch

    from actors.engines.hf import HFEngine
    from actors.rendezvous import bind_master_store
    from actors.weight_group import WeightGroup, tensor_metas

    torch.set_num_threads(1)
    engine = HFEngine(folder, dtype=torch.float32)
    distinct = {id(p): n for n, p in engine.model.named_parameters()}
    params = dict(engine.model.named_parameters())
    versions = {v: {name: params[name].detach() + v for name in distinct.values()} for v in (1, 2)}
    metas = tensor_metas(versions[1])
    store = bind_master_store(timeout_s=60.0)
    sender: list = []

    def send() -> None:
        group = WeightGroup(
            "127.0.0.1", store.port, 0, 2, "gloo", 120.0, store, 60.0, local_ip="127.0.0.1"
        )
        for v in (1, 2):
            group.send(versions[v], metas, v)
        sender.append(group)

    thread = threading.Thread(target=send)
    thread.start()
    receiver = WeightGroup(
        "127.0.0.1", store.port, 1, 2, "gloo", 120.0, join_timeout_s=60.0, local_ip="127.0.0.1"
    )

    def streamed() -> None:
        version, tensors = receiver.receive(metas)
        engine.load_weights(tensors, version)

    def as_dict() -> None:
        version, tensors = receiver.receive(metas)
        engine.load_weights(dict(tensors), version)

    peaks = (_peak_during(streamed), _peak_during(as_dict))
    thread.join()
    loaded = all(torch.equal(params[n], versions[2][n]) for n in distinct.values())
    sizes = [t.numel() * t.element_size() for t in versions[1].values()]
    out.put((*peaks, sum(sizes), max(sizes), loaded and engine.policy_version == 2))
    receiver.close()
    sender[0].close()


def test_an_engine_loads_a_broadcast_tensor_by_tensor(tmp_path: Path, tok):
    import torch
    from tiny_models import save_model, tiny_qwen2_config
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(2)
    model = Qwen2ForCausalLM(
        tiny_qwen2_config(
            4096, tok, hidden_size=256, intermediate_size=1024, num_hidden_layers=24,
            num_attention_heads=4, num_key_value_heads=2,
        )
    )  # fmt: skip
    folder = save_model(model, tok, tmp_path / "deeper_qwen2")
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        child = context.Process(target=_receive_twice, args=(str(folder), out))
        child.start()
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    streamed, as_dict, model_bytes, largest, loaded = out.get(timeout=300)
    child.join(timeout=60)
    print(
        f"receiving {model_bytes / 2**20:.0f} MiB (largest tensor {largest / 2**20:.1f} MiB): "
        f"peak extra {streamed / 2**20:.1f} MiB streamed, {as_dict / 2**20:.1f} MiB as a dict"
    )
    assert loaded  # the second broadcast's weights, every one
    assert streamed <= 1.5 * largest + (1 << 20)  # one tensor in flight (+1 MiB of noise)
    assert as_dict >= 0.8 * model_bytes  # the old way holds the model: the measurement sees it
