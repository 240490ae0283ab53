"""Crash-consistent file writes: a file a resume trusts is either the old one or the new one.

:func:`write_atomic` writes to a temporary name in the same directory, flushes and fsyncs
it, renames it over the target (atomic on POSIX within one filesystem) and fsyncs the
directory, so a ``kill -9`` or a power cut at any moment leaves the old content or the new,
never a truncated file. :func:`fsync_tree` makes a directory written by others (DeepSpeed's
checkpoint files) durable before it is declared complete. A full disk surfaces as
:class:`DiskFullError` naming the path and the bytes the write needed.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class DiskFullError(OSError):
    """No space left while writing ``path``; ``needed_bytes`` is what the write needed (an
    estimate for a checkpoint: the size of the previous complete one) and ``free_bytes``
    what the filesystem had free afterwards."""

    def __init__(self, path: Path, needed_bytes: int, free_bytes: int) -> None:
        self.path = Path(path)
        self.needed_bytes = int(needed_bytes)
        self.free_bytes = int(free_bytes)
        super().__init__(
            errno.ENOSPC,
            f"disk full writing {self.path}: needed about {self.needed_bytes:,} bytes, "
            f"{self.free_bytes:,} free on its filesystem",
        )


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding ``path`` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def is_disk_full(error: BaseException) -> bool:
    """True for ENOSPC / EDQUOT, also when wrapped (``__cause__``, ``__context__``) or
    reported as text by another process (a Ray task error's message)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def fsync_dir(directory: Path) -> None:
    """fsync a directory's entry list (a rename or a new file in it becomes durable)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (module docstring).

    Raises:
        DiskFullError: the filesystem is full (the old file, if any, is intact; the
            temporary file is removed).
        OSError: any other write error (likewise).
    """
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise DiskFullError(path, len(payload), free_bytes(path.parent)) from e
        raise
    fsync_dir(path.parent)


def fsync_tree(root: Path) -> int:
    """fsync every file and directory under ``root`` (files first); returns the total size
    of the files in bytes."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            total += os.path.getsize(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(directory))
    return total
