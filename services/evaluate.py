"""``stppo eval``: run the agent without training and score it per QA set.

Greedy decoding (temperature 0, one episode per question) on the validation or test split of
each QA set; reports exact match (QA) or option accuracy (multiple choice), mean searches and
turns, and the malformed-output rate, as a table and a JSON file.

Modes (``--mode``): ``agent`` (the multi-turn search agent, :mod:`actors.rollout`), and the
two one-turn baselines of the Search-R1 / ST-PPO papers (:mod:`actors.baselines`):
``closed_book`` (no retrieval) and ``rag`` (top-k passages for the raw question in the
prompt); ``all`` runs the three on the same questions, and the table shows them side by
side. Every mode is scored by the same reward code (:func:`actors.reward.compute_reward`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.config import RunConfig

EVAL_MODES: tuple[str, ...] = ("closed_book", "rag", "agent")
"""Every evaluation mode, in report order (baselines first, as in the papers' tables)."""


@dataclass
class SetScore:
    """Scores of one QA set (or ``all``).

    Attributes:
        data_source: QA set name, or ``all``.
        num_questions: questions scored.
        success_rate: exact match (QA) / option accuracy (MC), 0..1.
        searches_mean: ``<search>`` calls per question.
        turns_mean: policy turns per question.
        malformed_rate: share of outputs without a well-formed ``<answer>``, 0..1.
        retrieval_failed: questions whose search failed after retries (scored 0).
        mode: how the questions were put: ``agent``, ``closed_book`` or ``rag``.
    """

    data_source: str
    num_questions: int
    success_rate: float
    searches_mean: float
    turns_mean: float
    malformed_rate: float
    retrieval_failed: int
    mode: str = "agent"


def parse_modes(mode: str) -> list[str]:
    """The modes ``--mode`` names: one of :data:`EVAL_MODES`, or ``all`` (every one, in order).

    Raises:
        ValueError: any other value.
    """
    if mode == "all":
        return list(EVAL_MODES)
    if mode not in EVAL_MODES:
        raise ValueError(f"--mode must be one of {', '.join(EVAL_MODES)} or all, got {mode!r}")
    return [mode]


def score_set(data_source: str, trajectories: list[Any], mode: str = "agent") -> SetScore:
    """Aggregate evaluated trajectories of one set (in one ``mode``).

    Raises:
        ValueError: no trajectories.
    """
    n = len(trajectories)
    if n == 0:
        raise ValueError(f"no trajectories to score for {data_source}")
    return SetScore(
        data_source=data_source,
        num_questions=n,
        success_rate=sum(bool(t.success) for t in trajectories) / n,
        searches_mean=sum(t.num_searches for t in trajectories) / n,
        turns_mean=sum(t.num_turns for t in trajectories) / n,
        malformed_rate=sum(t.malformed_reason is not None for t in trajectories) / n,
        retrieval_failed=sum(bool(t.retrieval_failed) for t in trajectories),
        mode=mode,
    )


def summarize_eval(trajectories: list[Any]) -> dict[str, Any]:
    """Flat summary for logs: overall scores plus ``success_rate/<set>`` per QA set."""
    if not trajectories:
        return {"num_questions": 0}
    overall = asdict(score_set("all", trajectories))
    overall.pop("data_source")
    overall.pop("mode")
    for source in sorted({t.data_source for t in trajectories}):
        group = [t for t in trajectories if t.data_source == source]
        overall[f"success_rate/{source}"] = score_set(source, group).success_rate
    return overall


def resolve_policy_dir(checkpoint: Path | None, default: Path) -> Path:
    """The HF model folder to evaluate: the ``hf_policy`` export of a run checkpoint (what
    :meth:`learner.trainer.Learner.save_checkpoint` writes), else ``checkpoint`` itself if it
    is an HF model folder (``config.json`` and ``*.safetensors``); ``default`` (the base
    model) when ``checkpoint`` is None.

    Raises:
        FileNotFoundError: ``checkpoint`` holds none of them.
    """
    if checkpoint is None:
        return default
    # hf_policy/ first: a driver checkpoint also holds a config.json (the run config)
    for candidate in (checkpoint / "hf_policy", checkpoint):
        if (candidate / "config.json").exists() and any(candidate.glob("*.safetensors")):
            return candidate
    raise FileNotFoundError(
        f"{checkpoint} is neither an HF model folder nor a checkpoint with hf_policy/"
    )


def evaluate_records(
    worker: Any, records: list[dict], batch_size: int = 16, mode: str = "agent"
) -> list[Any]:
    """Greedy trajectories for ``records`` in batches of ``batch_size``, with a progress bar.

    ``agent`` runs the worker's multi-turn rollout; ``closed_book`` and ``rag`` run
    :func:`actors.baselines.run_single_turn` on the worker's engine, tokenizer and
    retrieval client.

    Raises:
        ValueError: unknown ``mode``.
    """
    from tqdm import tqdm

    from actors.baselines import run_single_turn

    if mode not in EVAL_MODES:
        raise ValueError(f"unknown eval mode {mode!r}; expected one of {EVAL_MODES}")
    out: list[Any] = []
    for i in tqdm(range(0, len(records), batch_size), desc=f"eval {mode}", unit="batch"):
        batch = records[i : i + batch_size]
        if mode == "agent":
            out.extend(worker.rollout(batch, greedy=True))
        else:
            out.extend(
                run_single_turn(
                    worker.engine, worker.tokenizer, batch, mode, worker.cfg, client=worker.client
                )
            )
    return out


def run_eval(
    cfg: RunConfig,
    checkpoint: Path | None,
    split: str,
    limit: int = 100,
    out: Path | None = None,
    modes: list[str] | None = None,
    batch_size: int = 16,
) -> list[SetScore]:
    """Evaluate a policy on ``split`` of every configured QA set (first ``limit`` each).

    Starts the retrieval server (unless ``retrieval.url`` is set), loads the policy into an
    HF engine in this process, runs each of ``modes`` (default ``["agent"]``) on the same
    questions, prints a table (success side by side per mode, then details) and writes JSON
    to ``out`` (default ``<run_dir>/eval_<split>.json``), a markdown table beside it, and one
    record per question and mode (:mod:`services.records`, tag ``eval_<split>``) to
    ``<out stem>_samples.jsonl`` (replaced, not appended to).

    Returns:
        One :class:`SetScore` per (mode, set), modes in the order given.

    Raises:
        FileNotFoundError: ``checkpoint`` is not a policy (see :func:`resolve_policy_dir`).
        ValueError: an unknown mode.
    """
    from actors.rollout import RolloutWorker
    from retrieval_server.launcher import start_server, stop_server
    from services.records import append_records, eval_records
    from services.sampler import qa_sets

    modes = list(modes or ["agent"])
    for m in modes:
        parse_modes(m)
    policy_dir = resolve_policy_dir(checkpoint, cfg.model.path)
    out = out or cfg.run_dir / f"eval_{split}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    samples = out.with_name(f"{out.stem}_samples.jsonl")
    samples.unlink(missing_ok=True)
    server = None
    if cfg.retrieval.url:
        url = cfg.retrieval.url
    else:
        server = start_server(
            cfg.retrieval.server, out.parent / "eval_retrieval.log", startup_timeout_s=600
        )
        url = server.url
    try:
        worker = RolloutWorker(str(policy_dir), cfg.rollout, url, seed=cfg.run.seed)
        scores = []
        for name, records in qa_sets(cfg.data, split).items():
            records = records[:limit]
            for m in modes:
                trajectories = evaluate_records(worker, records, batch_size, mode=m)
                scores.append(score_set(name, trajectories, mode=m))
                append_records(
                    samples,
                    eval_records(trajectories, f"eval_{split}", 0, cfg.run.record_text_chars, m),
                )
        worker.close()
    finally:
        if server is not None:
            stop_server(server)
    normalization = cfg.rollout.answer_normalization
    print_eval_tables(scores, f"{policy_dir} on {split} (greedy, {normalization} exact match)")
    out.write_text(
        json.dumps(
            {
                "policy": str(policy_dir),
                "split": split,
                "modes": modes,
                "limit": limit,
                "answer_normalization": normalization,
                "scores": [asdict(s) for s in scores],
            },
            indent=2,
        )
    )
    md = out.with_suffix(".md")
    md.write_text(eval_markdown(scores))
    print(f"wrote {out}, {md} and {samples}")
    return scores


def eval_markdown(scores: list[SetScore]) -> str:
    """The side-by-side success table, then the details table, as markdown."""
    header, rows = side_by_side(scores)
    detail = [
        [s.data_source, s.mode, str(s.num_questions), f"{s.success_rate:.3f}",
         f"{s.searches_mean:.2f}", f"{s.turns_mean:.2f}", f"{s.malformed_rate:.2f}",
         str(s.retrieval_failed)]
        for s in scores
    ]  # fmt: skip
    detail_header = [
        "set",
        "mode",
        "n",
        "EM / acc",
        "searches",
        "turns",
        "malformed",
        "retr. failed",
    ]
    return f"{markdown_table(header, rows)}\n\n{markdown_table(detail_header, detail)}\n"


def side_by_side(scores: list[SetScore]) -> tuple[list[str], list[list[str]]]:
    """Success per set (rows) and mode (columns), as ``(header, rows)`` of strings.

    Example: scores of sets ``single_hop`` and modes ``closed_book``, ``agent`` give
    ``(["set", "n", "closed_book", "agent"], [["single_hop", "50", "0.040", "0.120"]])``.

    Raises:
        ValueError: one set was scored on different numbers of questions across modes.
    """
    modes = list(dict.fromkeys(s.mode for s in scores))
    sets = list(dict.fromkeys(s.data_source for s in scores))
    by_key = {(s.data_source, s.mode): s for s in scores}
    rows = []
    for name in sets:
        sizes = {by_key[(name, m)].num_questions for m in modes if (name, m) in by_key}
        if len(sizes) != 1:
            raise ValueError(f"{name} was scored on different numbers of questions: {sizes}")
        cells = [
            f"{by_key[(name, m)].success_rate:.3f}" if (name, m) in by_key else "-" for m in modes
        ]
        rows.append([name, str(sizes.pop()), *cells])
    return ["set", "n", *modes], rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table (header row, separator, one line per row)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def print_eval_tables(scores: list[SetScore], title: str) -> None:
    """Print the side-by-side success table, then one detail row per (set, mode)."""
    from rich.console import Console
    from rich.table import Table

    # Rich wraps at 80 columns when stdout is not a terminal (logs, CI): give tables room
    console = Console(width=None if sys.stdout.isatty() else 160)
    header, rows = side_by_side(scores)
    summary = Table(title=f"{title}: exact match / accuracy")
    for col in header:
        summary.add_column(col)
    for row in rows:
        summary.add_row(*row)
    console.print(summary)
    detail = Table(title="details")
    cols = ("set", "mode", "n", "EM / acc", "searches", "turns", "malformed", "retr. failed")
    for col in cols:
        detail.add_column(col)
    for s in scores:
        detail.add_row(
            s.data_source, s.mode, str(s.num_questions), f"{s.success_rate:.3f}",
            f"{s.searches_mean:.2f}", f"{s.turns_mean:.2f}", f"{s.malformed_rate:.2f}",
            str(s.retrieval_failed),
        )  # fmt: skip
    console.print(detail)


@dataclass(frozen=True)
class PairedGain:
    """The change in success between two evaluations of the same questions.

    Attributes:
        n: questions in both evaluations.
        fixed: questions wrong in the first and right in the second.
        broken: questions right in the first and wrong in the second.
        gain: ``(fixed - broken) / n``, the change in success rate.
        low, high: its 95% interval, Newcombe's method 10 for paired proportions (Wilson
            intervals combined with the pairs' correlation).
        p_value: exact two-sided McNemar test (binomial on the ``fixed + broken``
            discordant questions, p = 1/2); 1.0 without any.
    """

    n: int
    fixed: int
    broken: int
    gain: float
    low: float
    high: float
    p_value: float


def paired_gain(first: dict[str, bool], second: dict[str, bool]) -> PairedGain | None:
    """The change in success from ``first`` to ``second`` (question id -> correct) over the
    questions both scored, with its 95% interval (R. G. Newcombe, "Improved confidence
    intervals for the difference between binomial proportions based on paired data",
    Statistics in Medicine 17, 1998, method 10) and the exact McNemar p-value. A paired
    interval is narrower than two separate ones: questions both evaluations got right or
    wrong carry no noise. None when no question is in both."""
    import math

    from scipy.stats import binomtest

    ids = sorted(set(first) & set(second))
    n = len(ids)
    if n == 0:
        return None
    e = sum(first[q] and second[q] for q in ids)  # right in both
    f = sum(first[q] and not second[q] for q in ids)  # broken
    g = sum(not first[q] and second[q] for q in ids)  # fixed
    h = n - e - f - g
    p1, p2 = (e + f) / n, (e + g) / n
    l1, u1 = binomtest(e + f, n).proportion_ci(method="wilson")
    l2, u2 = binomtest(e + g, n).proportion_ci(method="wilson")
    a = (e + f) * (g + h) * (e + g) * (f + h)
    phi = (e * h - f * g) / math.sqrt(a) if a else 0.0
    # Newcombe's theta = p1 - p2 has (theta - delta, theta + eps); the gain is -theta
    delta = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    eps = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    gain = p2 - p1
    p_value = binomtest(g, f + g, 0.5).pvalue if f + g else 1.0
    return PairedGain(n, g, f, gain, gain - eps, gain + delta, float(p_value))


def _correct_by_question(run_dir: Path, tag: str) -> dict[str, bool]:
    from services.run_records import read_records

    return {
        str(r["question_id"]): bool(r.get("correct"))
        for r in read_records(run_dir / "eval_samples.jsonl")
        if r.get("tag") == tag and "question_id" in r
    }


def result_line(run_dir: Path) -> str | None:
    """The run's result in one line: greedy validation success when RL started (tag
    ``start``, or ``resume``) and at the end (``eval.jsonl``), each with its 95% Wilson
    interval (scipy's ``binomtest(...).proportion_ci(method="wilson")``), and whether the
    intervals overlap: on a few dozen questions a difference inside them is not evidence
    of learning. None without both evaluations."""
    from scipy.stats import binomtest

    from services.run_records import read_records

    evals = {r.get("tag"): r for r in read_records(run_dir / "eval.jsonl")}
    first = evals.get("start") or evals.get("resume")
    end = evals.get("end")
    if not first or not end or not first.get("num_questions") or not end.get("num_questions"):
        return None
    parts, intervals = [], []
    for what, record in (("when RL started", first), ("at the end", end)):
        n = int(record["num_questions"])
        k = round(float(record["success_rate"]) * n)
        low, high = binomtest(k, n).proportion_ci(method="wilson")
        intervals.append((low, high))
        parts.append(f"{what} {k}/{n} = {k / n:.3f} [{low:.2f}, {high:.2f}]")
    (low0, high0), (low1, high1) = intervals
    verdict = (
        "the intervals overlap: more questions (run.eval_questions) or steps would tell"
        if low1 <= high0 and low0 <= high1
        else "the intervals do not overlap"
    )
    line = (
        f"validation success (greedy): {parts[0]}; {parts[1]} after "
        f"{end.get('learner_step', 0)} RL step(s) (95% Wilson intervals; {verdict})"
    )
    paired = paired_gain(
        _correct_by_question(run_dir, first["tag"]), _correct_by_question(run_dir, "end")
    )
    if paired is None:
        return line
    if paired.low <= 0.0 <= paired.high:
        verdict = "the interval holds 0: no evidence of a change"
    else:
        verdict = "above 0: RL gained" if paired.gain > 0 else "below 0: RL lost"
    return (
        f"{line}; paired on the same {paired.n} questions: {paired.fixed} fixed, "
        f"{paired.broken} broken, gain {paired.gain:+.3f} [{paired.low:+.2f}, "
        f"{paired.high:+.2f}] (95%, Newcombe; exact McNemar p = {paired.p_value:.2g}; "
        f"{verdict})"
    )
