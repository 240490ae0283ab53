"""Learner ranks as Ray actors for the multi-rank tests (a real gloo group, real
DeepSpeed), and how their weights are compared with one rank's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from learner.config import LearnerConfig

PARAM_RTOL, PARAM_ATOL = 1e-5, 5e-7
"""Parameters: fp32 weights after two AdamW steps of lr 1e-3, ``micro_batch_size`` 1 on both
sides (the same forward shapes), so only the gradient's summation order differs (all-reduce
vs accumulation). Measured: max |dw| 1.6e-7 (about one fp32 ulp at |w| ~ 1). With other
micro-batch shapes the padding changes the forward's rounding (~1e-7 relative) and AdamW's
first steps, ``lr * g / (|g| + eps)``, amplify it where a gradient element is ~1e-8 (a few
weights per tensor moved by up to ~2e-5): see the clip-bias test of
``tests/integration/test_learner_ranks.py``."""

PARAM_OUTLIER_FRACTION, PARAM_OUTLIER_ATOL = 1e-3, 2e-5
"""AdamW's amplification also reaches a rare weight when only the summation order differs:
CI measured one weight in 8,192 off by 1.1e-6 (rel 7e-5) where this session measured
1.6e-7 (a different thread count splits the reductions differently). So a tensor may have
up to 0.1% of its weights (at least one: a 32-entry bias has no 0.1%; on 4 ZeRO-3 ranks one
entry of a k-projection bias was 6.2e-7 off) outside the rtol/atol above, none by more
than 2e-5 (2% of lr)."""


def assert_same_weights(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within ``PARAM_RTOL``/``PARAM_ATOL`` but for AdamW-amplified outliers (above)."""
    close = torch.isclose(actual, expected, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    worst = float((actual - expected).abs().max())
    outliers = int((~close).sum())
    allowed = max(1, int(PARAM_OUTLIER_FRACTION * close.numel()))
    assert outliers <= allowed and worst <= PARAM_OUTLIER_ATOL, (
        f"{name}: {outliers} of {close.numel()} weights outside rtol {PARAM_RTOL} / atol "
        f"{PARAM_ATOL} (at most {allowed} may be), largest difference {worst:.2e}"
    )


class Ranks:
    """``world_size`` :class:`services.learner_group.LearnerRank` actors in one group
    (``env``: extra environment variables of their processes)."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None) -> None:
        import ray

        from services.learner_group import LearnerRank
        from services.ray_actors import _actor_env

        runtime_env = _actor_env()
        if env:
            runtime_env = {**runtime_env, "env_vars": {**runtime_env.get("env_vars", {}), **env}}
        cls = ray.remote(LearnerRank).options(num_cpus=1, runtime_env=runtime_env)
        self.actors = [cls.remote(rank, world_size) for rank in range(world_size)]
        addr, port = ray.get(self.actors[0].rendezvous_address.remote())
        ray.get([a.join.remote(addr, port, 300.0) for a in self.actors], timeout=300)

    def build(self, model: Path, config: LearnerConfig, algorithm) -> None:
        import ray

        args = (str(model), config, algorithm, 0, 1.0)
        ray.get([a.build.remote(*args) for a in self.actors], timeout=300)

    def call(self, method: str, *args):
        import ray

        return ray.get([a.call.remote(method, *args) for a in self.actors], timeout=300)


def rank_groups(
    sizes: tuple[int, ...], num_cpus: int, env: dict[str, str] | None = None
) -> Iterator[dict[int, Ranks]]:
    """A :class:`Ranks` group of each size in ``sizes`` on a local Ray cluster of
    ``num_cpus`` (started here unless one is running, and shut down after); the body of a
    module-scoped fixture: ``yield from rank_groups((1, 2), num_cpus=4)``."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    out = {size: Ranks(size, env) for size in sizes}
    yield out
    for ranks in out.values():
        for actor in ranks.actors:
            ray.kill(actor)
    if started:
        ray.shutdown()
