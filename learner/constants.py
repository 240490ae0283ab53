"""The algorithm's numeric constants, in one torch-free module (the config and the loss
functions read the same values; ``learner.config`` imports no torch)."""

from __future__ import annotations

LOG_RATIO_CLAMP = 20.0
"""|log ratio| bound applied before ``exp`` (token or turn level), so a very stale token gives
a ratio of e^20 instead of inf; beyond the bound the ratio carries no gradient."""

LOW_VAR_KL_BOUND = 10.0
"""``low_var_kl`` is k3 clamped to [-bound, bound] (verl's ``low_var_kl``): one token pushed
12 nats from the reference gives 10 instead of k3's 1.6e5."""

DEFAULT_TAU = 0.01
"""Default threshold of the ``triggered`` clipping-bias scale
(:func:`learner.losses.clip_bias_scale`; ``algorithm.tau``)."""
