"""Building a rollout actor's generation engine, and serving its metrics.

:func:`build_engine` makes the engine ``rollout.engine`` names on the machine the actor
runs on: the dtype resolved there (:mod:`actors.hardware`), GPUs given to the process
checked usable, vLLM checked installed (or the HF engine where
``rollout.engine_fallback`` allows it).
"""

from __future__ import annotations

import importlib.util
import logging

from actors.config import RolloutConfig
from actors.engines.protocol import GenerationEngine
from actors.rendezvous import advertised_host

logger = logging.getLogger(__name__)


VLLM_MISSING = (
    "rollout.engine = 'vllm' but vLLM is not installed here (install with scripts/setup.sh "
    "on CPU, or pip install -e '.[gpu]' on GPU; or set rollout.engine_fallback = true to "
    "use the HF engine)"
)


class EngineUnavailableError(RuntimeError):
    """The configured generation engine is not installed (and no fallback was asked for)."""


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (found, not imported)."""
    return importlib.util.find_spec("vllm") is not None


def build_engine(model_path: str, cfg: RolloutConfig, seed: int) -> GenerationEngine:
    """The engine ``cfg.engine`` names (``hf`` or ``vllm``), loaded from ``model_path``.

    ``vllm`` where vLLM is not installed (a machine set up without the ``cpu`` / ``gpu``
    extra) is an error, or the HF engine with one logged line under
    ``rollout.engine_fallback``. ``dtype = "auto"`` is resolved here, on the machine the
    engine runs on (:func:`actors.hardware.resolve_dtype`). The HF engine runs on the GPU
    where this process sees one (a rollout actor given ``ray.rollout_actor_gpus > 0``), on
    the CPU otherwise.

    Raises:
        EngineUnavailableError: vLLM asked for, not installed, no fallback allowed.
        actors.hardware.GPUUnavailableError: GPUs given to this process that torch cannot
            use (:func:`actors.hardware.check_visible_gpus`).
    """
    import torch

    from actors.hardware import check_visible_gpus, resolve_dtype

    check_visible_gpus("rollout actor")
    dtype = resolve_dtype(cfg.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    engine = cfg.engine
    if engine == "vllm" and not vllm_installed():
        if not cfg.engine_fallback:
            raise EngineUnavailableError(VLLM_MISSING)
        logger.warning(
            "rollout.engine = 'vllm' but vLLM is not installed here: using the HF engine "
            "(rollout.engine_fallback = true)"
        )
        engine = "hf"
    logger.info("rollout engine %s, dtype %s (%s)", engine, dtype.name, dtype.reason)
    if engine == "hf":
        from actors.engines.hf import HFEngine

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return HFEngine(model_path, seed=seed, dtype=dtype.torch_dtype, device=device)
    from actors.engines.vllm import VLLMEngine

    return VLLMEngine(
        model_path,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        kv_cache_gib=cfg.vllm_kv_cache_gib,
        dtype="float32" if dtype.name == "fp32" else "bfloat16",
        max_model_len=cfg.max_response_tokens + 2048,
        seed=seed,
        log_stats=cfg.engine_metrics_port is not None,
    )


def serve_engine_metrics(engine: GenerationEngine, host: str, port: int):
    """Serve this process's Prometheus registry, where a vLLM engine built with
    ``log_stats=True`` records its ``vllm:*`` series, on ``host:port`` (0 = a free port).

    Returns:
        ``(url, server)`` with the bound port read back, or ``(None, None)`` for an engine
        that records no metrics (HF, scripted).

    Raises:
        OSError: the port is taken (a fixed port with two actors on one node).
    """
    from actors.engines.vllm import VLLMEngine

    if not isinstance(engine, VLLMEngine):
        logger.info(
            "rollout.engine_metrics_port is set but the %s engine records no "
            "metrics: nothing served",
            type(engine).__name__,
        )
        return None, None
    from prometheus_client import REGISTRY, start_http_server

    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    bound = server.server_address[1]
    url = f"http://{advertised_host(host)}:{bound}/metrics"
    logger.info("engine metrics: %s", url)
    return url, server
