"""Interruptible generation: weight updates that land while a rollout batch runs.

A rollout actor serves two kinds of calls: ``rollout`` (minutes: a multi-turn batch) and
weight loads (``load_weights``, ``receive_weights``). Without interruption a load waits for
the whole batch, so new weights wait for the slowest episode. With
``rollout.interrupt_every_tokens = N > 0`` the loads run on a second thread of the actor
(a Ray concurrency group, :mod:`services.ray_actors`) and are applied at the next *safe
point* of the running batch: between two turns, and within a turn after every ``N``
decoded tokens. Sequences in flight continue under the new weights, and every token
records the version that sampled it (:attr:`GenerationResult.token_versions`), so the
learner's ratios stay exact (the behaviour log-prob of a token is its probability under
the version that produced it).

:class:`WeightGate` is the one synchronisation object: the generating thread holds it
while it uses the model and offers it at safe points; a loader takes it, copies the new
weights in, and gives it back. Pure ``threading``, no torch, no Ray.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Interrupt:
    """Where a generation may let a pending weight update in.

    Attributes:
        every_tokens: decode tokens between two safe points within a generation (>= 1).
        safe_point: called at each; returns only when no update waits any more (the
            engine re-reads its ``policy_version`` afterwards). ``WeightGate.safe_point``.
        pending: True while an update waits (``WeightGate.update_waiting``); engines that
            must release their running requests before weights may change (vLLM: the KV
            blocks are freed and the prefix cache reset by the load) ask it first and
            call ``safe_point`` only then. None: unknown (such engines then suspend and
            resume their requests at every safe point).
    """

    every_tokens: int
    safe_point: Callable[[], None]
    pending: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if self.every_tokens < 1:
            raise ValueError(f"every_tokens must be >= 1, got {self.every_tokens}")


class WeightGate:
    """Mutual exclusion between generation and weight loads, with hand-over points.

    - :meth:`generating` (the rollout thread) holds the gate for a whole batch;
    - :meth:`updating` (a loader thread) waits for the gate, then holds it while it copies
      weights into the engine;
    - :meth:`safe_point` (the rollout thread, between turns and every N tokens) lets every
      waiting loader through, then takes the gate back. Without a safe point a load waits
      for the end of the batch (``interrupt_every_tokens = 0``: the behaviour before
      interruptible generation).

    Counters: ``num_inflight_updates`` counts loads that went through a safe point (landed
    while a batch ran, or while ``in_flight()`` is True: under continuous batching the
    episodes of a call can be in flight between two holders of the gate), ``num_updates``
    all loads.

    Example::

        gate = WeightGate()
        with gate.generating():           # rollout thread
            ...; gate.safe_point(); ...
        with gate.updating():             # loader thread
            engine.load_weights(state_dict, version)
    """

    def __init__(self, in_flight: Callable[[], bool] | None = None) -> None:
        self._in_flight = in_flight or (lambda: False)
        self._lock = threading.Lock()  # held by whoever uses the model
        self._cond = threading.Condition()
        self._waiting = 0  # loaders waiting for or holding the lock
        self._batch_running = False
        self._version_cond = threading.Condition()
        self.num_updates = 0
        self.num_inflight_updates = 0

    @contextlib.contextmanager
    def generating(self) -> Iterator[WeightGate]:
        """Hold the gate for a batch (the rollout thread). Loaders that wait when the gate
        is handed over go first: the start of a batch is a safe point (under continuous
        batching another thread's batch may have tokens in flight already)."""
        while True:
            with self._cond:
                while self._waiting:
                    self._cond.wait()
            self._lock.acquire()
            if not self._waiting:
                break
            self._lock.release()  # a loader queued while this thread waited for the lock
        self._batch_running = True
        try:
            yield self
        finally:
            self._batch_running = False
            self._lock.release()

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Hold the gate to load weights (a loader thread); waits for a safe point or the
        end of the running batch."""
        with self._cond:
            self._waiting += 1
        try:
            with self._lock:
                self.num_updates += 1
                self.num_inflight_updates += int(self._batch_running or self._in_flight())
                yield
        finally:
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()
            with self._version_cond:
                self._version_cond.notify_all()

    @property
    def update_waiting(self) -> bool:
        """A loader waits for the gate (read without a lock: a hint for the hot loop)."""
        return self._waiting > 0

    def safe_point(self) -> None:
        """Called by the thread that holds :meth:`generating`: if loaders wait, let them
        all through (release, wait until none waits, re-acquire); otherwise return at once.
        """
        if not self._waiting:
            return
        self._lock.release()
        try:
            with self._cond:
                while self._waiting:
                    self._cond.wait()
        finally:
            self._lock.acquire()

    def wait_for_version(self, current: Callable[[], int], at_least: int, timeout_s: float) -> int:
        """Block until ``current() >= at_least`` (a load queued on the loader thread has
        landed), at most ``timeout_s`` seconds; return ``current()``.

        Raises:
            TimeoutError: the version did not arrive in time (names both versions).
        """
        deadline = time.monotonic() + timeout_s
        with self._version_cond:
            while current() < at_least:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"policy_version {at_least} did not arrive within {timeout_s:g} s "
                        f"(engine at {current()})"
                    )
                self._version_cond.wait(min(left, 1.0))
        return current()
