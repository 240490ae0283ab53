"""The parts of the driver's loop (:mod:`services.driver` builds them and routes between
them): ``bootstrap`` (run directory, retrieval, Ray, observability), ``fleet`` (rollout
actors), ``pipeline`` (admission, the buffer, the learner step in flight), ``sync`` (weights
to the engines), ``live_config`` (a new config into effect), ``checkpoint`` (driver state,
crash-consistent checkpoints), ``report`` (records, metrics, progress, status),
``phases`` (warm start and evaluation) and ``guard`` / ``autopilot`` (the stability guard's
decisions, and their actions and log). No part imports the driver."""
