"""Paths of the data committed under ``tests/fixtures/``."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_CORPUS = FIXTURES / "retrieval" / "passages.jsonl"
"""The 36-passage retrieval corpus (``tests/fixtures/retrieval/README.md``)."""
