"""``python -m retrieval_server``: build the index and/or serve it.

Every :class:`~retrieval_server.config.RetrievalServerConfig` field is a flag
(``--method dense --port 8002 --max-queries-per-request 64``; booleans take
``--build-missing-index`` / ``--no-build-missing-index``). ``--build-only`` builds the index of
``--method`` (hybrid: bm25 and dense) and prints the build report as JSON; ``--force-build``
rebuilds even when an up-to-date index exists.

Example::

    python -m retrieval_server --method bm25 --build-only
    python -m retrieval_server --method bm25 --port 8001
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from retrieval_server.config import RetrievalServerConfig


def build_parser() -> argparse.ArgumentParser:
    """One flag per config field (values are validated by the pydantic model, not here)."""
    parser = argparse.ArgumentParser(
        prog="python -m retrieval_server", description=__doc__.split("\n\n")[0]
    )
    for name, info in RetrievalServerConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{info.description or ''} (default: {info.default})"
        if info.annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(flag, dest=name, help=help_text)
    parser.add_argument("--build-only", action="store_true", help="Build the index and exit.")
    parser.add_argument("--force-build", action="store_true", help="Rebuild even if up to date.")
    parser.add_argument(
        "--build-lock",
        type=Path,
        default=None,
        help="flock this file while encoding each dense chunk (e.g. .cache/heavy.lock).",
    )
    return parser


def parse_config(args: argparse.Namespace) -> RetrievalServerConfig:
    """The config from the flags that were given (others keep their defaults).

    Raises:
        pydantic.ValidationError: a value is invalid (the message names the field).
    """
    given: dict[str, Any] = {
        name: value
        for name, value in vars(args).items()
        if name in RetrievalServerConfig.model_fields and value is not None
    }
    return RetrievalServerConfig.model_validate(given)


PARENT_PID_ENV = "RETRIEVAL_SERVER_PARENT_PID"
"""Set by :func:`retrieval_server.launcher.start_server`: the server stops once that process
is gone (it was reparented), so a ``kill -9`` of a driver leaves no server holding its port."""


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> threading.Thread:
    """Sends this process SIGTERM (uvicorn's graceful stop) once its parent is no longer
    ``parent_pid``: the parent died and the process was reparented to init or a subreaper.

    Unlike ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked the child ends,
    this follows the parent process, so a server started from a short-lived thread (the
    supervisor's restarts) lives as long as the process that started it.

    Returns:
        the daemon thread that polls ``os.getppid()`` every ``interval_s`` seconds.
    """

    def poll() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=poll, name="watch-parent", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if os.environ.get(PARENT_PID_ENV):
        watch_parent(int(os.environ[PARENT_PID_ENV]))
    try:
        config = parse_config(args)
    except ValidationError as exc:
        print(f"invalid option: {exc}", file=sys.stderr)
        return 2
    if args.build_only or args.force_build:
        import logging

        from retrieval_server.index import build_index

        logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(message)s")

        reports = build_index(config, force=args.force_build, lock_path=args.build_lock)
        print(json.dumps([asdict(r) for r in reports], default=str, indent=2))
        if args.build_only:
            return 0
    from retrieval_server.server import serve

    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
