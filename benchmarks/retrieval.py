"""Retrieval server benchmark on the full corpus, all measured in one run.

Measures, over real HTTP against ``python -m retrieval_server`` (uvicorn subprocess, loopback):

1. queries/s and p50/p99 request latency at concurrency 1, 16, 64 for batch sizes 1 and 32
   (closed loop: each client sends its next request when the previous one is answered);
2. the same query batches through in-process ``bm25s`` (``bm25s.tokenize`` + ``retrieve`` on
   the same index: the HTTP overhead ratio) and through ``rank_bm25`` (``BM25Okapi``, a popular
   pure-Python baseline; on a subsample of queries because it scores every passage in numpy
   per query term);
3. recall@3 per QA set for bm25, dense and hybrid (a normalised gold answer string appears in
   one of the top-3 passages; medical_mc uses the text of the correct option and queries with
   the vignette only, without the option lines);
4. a bounded soak: 60 s at concurrency 64, batch 1, counting errors and the server's RSS growth;
5. a hostile soak (``--hostile-soak-only`` runs just this one): 60 s at concurrency 64 where
   every 5th request is bad -- malformed JSON, a Content-Length over the limit, a chunked body
   streamed past the limit with no Content-Length, or a request head left half-sent -- among
   real single queries; reports q/s and p99 of the real queries, errors on them (must be 0),
   the answers the bad ones got, and the server's RSS drift.

Targets (issue 4): HTTP throughput at batch 32 >= 0.8x in-process bm25s; p99 < 100 ms for a
single query at concurrency 16; soak with zero errors and RSS growth < 5%.

Needs ``data/corpus/passages.jsonl``, ``data/qa/<set>/validation.jsonl`` and the built
indexes (``python -m retrieval_server --method hybrid --build-only``). Heavy: run it under the
shared lock::

    flock /work/main/.cache/heavy.lock .venv/bin/python benchmarks/retrieval.py

Prints a markdown table and writes the raw numbers to ``--json-out``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.env import configure_local_caches  # noqa: E402

configure_local_caches()

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from retrieval_server.config import RetrievalServerConfig  # noqa: E402
from retrieval_server.index import load_retriever, rss_gib  # noqa: E402
from retrieval_server.launcher import RunningServer, start_server, stop_server  # noqa: E402
from retrieval_server.retrievers import import_bm25s  # noqa: E402

QA_SETS = ("single_hop", "multi_hop", "medical_mc")
_OPTION_LINE = re.compile(r"^[A-D]\. ")


@dataclass
class LoadCell:
    """One closed-loop HTTP load run."""

    concurrency: int
    batch_size: int
    duration_s: float
    num_requests: int
    num_queries: int
    num_errors: int
    queries_per_s: float
    p50_ms: float
    p99_ms: float


@dataclass
class Report:
    """Everything the benchmark measured (written as JSON)."""

    num_passages: int = 0
    workers: int = 1
    index: dict = field(default_factory=dict)
    server_load_s: float = 0.0
    server_rss_gib: float = 0.0
    load: list[LoadCell] = field(default_factory=list)
    inprocess_bm25s_qps: dict[int, float] = field(default_factory=dict)
    inprocess_server_retriever_qps: dict[int, float] = field(default_factory=dict)
    rank_bm25: dict = field(default_factory=dict)
    recall_at_3: dict[str, dict[str, float]] = field(default_factory=dict)
    recall_questions: dict[str, int] = field(default_factory=dict)
    soak: dict = field(default_factory=dict)
    hostile_soak: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------ questions


def read_qa(qa_dir: Path, name: str) -> list[dict]:
    path = qa_dir / name / "validation.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `stppo prepare` first")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def query_and_golds(record: dict) -> tuple[str, list[str]]:
    """The search query and the gold strings whose presence counts as a hit."""
    if record["data_source"] == "medical_mc":
        stem = "\n".join(
            line for line in record["question"].splitlines() if not _OPTION_LINE.match(line)
        )
        meta = record["metadata"]
        return stem.strip(), [meta["options"][meta["answer_letter"]]]
    return record["question"], list(record["golden_answers"])


# ------------------------------------------------------------------------------ HTTP load


class RawHTTPConnection:
    """A minimal keep-alive HTTP/1.1 client on asyncio streams.

    httpx's async pool costs ~1 ms of client CPU per request and queues badly at 64
    connections; on 2 shared cores that cost would be charged to the server. This client
    only writes the request and reads ``Content-Length`` bytes back.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        response_head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(response_head[9:12])
        match = re.search(rb"(?i)content-length: *(\d+)", response_head)
        if match is None:
            raise ConnectionError("response without Content-Length")
        return status, await self.reader.readexactly(int(match.group(1)))

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def closed_loop(
    url: str, batches: list[list[str]], concurrency: int, duration_s: float, topk: int = 3
) -> tuple[list[float], int, int]:
    """Run ``concurrency`` clients for ``duration_s``; returns (latencies_s, queries, errors)."""
    host, port = url.removeprefix("http://").split(":")
    bodies = [json.dumps({"queries": b, "topk": topk}).encode() for b in batches]
    latencies: list[float] = []
    counters = {"queries": 0, "errors": 0, "next": 0}
    deadline = time.perf_counter() + duration_s

    async def client_loop() -> None:
        connection = RawHTTPConnection(host, int(port))
        while time.perf_counter() < deadline:
            i = counters["next"] % len(bodies)
            counters["next"] += 1
            start = time.perf_counter()
            try:
                status, _ = await connection.post("/retrieve", bodies[i])
                ok = status == 200
            except (OSError, asyncio.IncompleteReadError, ConnectionError):
                await connection.close()
                ok = False
            latencies.append(time.perf_counter() - start)
            if ok:
                counters["queries"] += len(batches[i])
            else:
                counters["errors"] += 1
        await connection.close()

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return latencies, counters["queries"], counters["errors"]


BAD_KINDS = ("malformed", "oversized", "streamed", "half_sent")
"""Bad requests of the hostile soak, sent in turn as every 5th request of each client."""


async def _send_bad(host: str, port: int, kind: str, limit_bytes: int) -> str:
    """One bad request on a fresh connection; returns what it got (``"413"``, ``"closed"``...)."""
    reader, writer = await asyncio.open_connection(host, port)
    head = f"POST /retrieve HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    try:
        if kind == "malformed":
            body = b'{"queries": ["lima", }'
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        elif kind == "oversized":
            writer.write(f"{head}Content-Length: {limit_bytes * 4}\r\n\r\n".encode() + b"{")
        elif kind == "half_sent":
            writer.write(head.encode())  # no blank line, ever: the server's head deadline ends it
        else:  # streamed: chunked, no Content-Length, up to 4x the limit
            writer.write(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            piece = b"a" * 65536
            answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
            sent = 0
            try:
                while not answer.done() and sent < 4 * limit_bytes:
                    writer.write(b"10000\r\n" + piece + b"\r\n")
                    sent += len(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
            except OSError:
                pass  # the server closed while we were still sending: look for its answer
            try:
                response_head = await asyncio.wait_for(answer, 30)
            except (OSError, asyncio.IncompleteReadError):
                return "reset_after_reject" if sent < 4 * limit_bytes else "reset"
            return response_head[9:12].decode()
        await writer.drain()
        response_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        return response_head[9:12].decode()
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return "closed"
    except TimeoutError:
        return "no_answer_30s"
    finally:
        writer.close()


async def hostile_loop(
    url: str, queries: list[str], concurrency: int, duration_s: float, limit_bytes: int
) -> dict:
    """Closed loop of ``concurrency`` clients; every 5th request of a client is bad (the
    half-sent ones are left open in the background while the client goes on).

    Returns latencies of the real queries (s), their count and errors, and a count of what
    each kind of bad request got back.
    """
    host, port = url.removeprefix("http://").split(":")
    bodies = [json.dumps({"queries": [q], "topk": 3}).encode() for q in queries]
    latencies: list[float] = []
    counters = {"queries": 0, "errors": 0, "next": 0}
    outcomes: dict[str, Counter] = {kind: Counter() for kind in BAD_KINDS}
    deadline = time.perf_counter() + duration_s

    background: list[asyncio.Future] = []

    async def record(kind: str) -> None:
        outcomes[kind][await _send_bad(host, int(port), kind, limit_bytes)] += 1

    async def client_loop(client: int) -> None:
        connection = RawHTTPConnection(host, int(port))
        for n in itertools.count():
            if time.perf_counter() >= deadline:
                break
            if n % 5 == 4:
                kind = BAD_KINDS[(n // 5 + client) % len(BAD_KINDS)]
                if kind == "half_sent":  # left hanging in the background, as an attacker would
                    background.append(asyncio.ensure_future(record(kind)))
                else:
                    await record(kind)
                continue
            i = counters["next"] % len(bodies)
            counters["next"] += 1
            start = time.perf_counter()
            try:
                status, _ = await connection.post("/retrieve", bodies[i])
                ok = status == 200
            except (OSError, asyncio.IncompleteReadError, ConnectionError):
                await connection.close()
                ok = False
            latencies.append(time.perf_counter() - start)
            counters["queries" if ok else "errors"] += 1
        await connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(client_loop(c) for c in range(concurrency)))
    load_s = time.perf_counter() - start
    await asyncio.gather(*background)
    return {
        "load_s": load_s,
        "latencies": latencies,
        "queries": counters["queries"],
        "errors": counters["errors"],
        "bad": {k: dict(v) for k, v in outcomes.items()},
    }


def hostile_soak(server: RunningServer, queries: list[str], duration_s: float) -> dict:
    """Run :func:`hostile_loop` at concurrency 64 and measure the server's RSS around it."""
    rss_start = process_rss_gib(server.process.pid)
    out = asyncio.run(
        hostile_loop(server.url, queries, 64, duration_s, server.config.max_body_bytes)
    )
    elapsed = out["load_s"]  # the half-sent ones still open after it are not load time
    rss_end = process_rss_gib(server.process.pid)
    lat_ms = np.array(out["latencies"]) * 1000
    return {
        "duration_s": round(elapsed, 2),
        "concurrency": 64,
        "valid_requests": len(out["latencies"]),
        "valid_errors": out["errors"],
        "queries_per_s": out["queries"] / elapsed,
        "p50_ms": float(np.percentile(lat_ms, 50)),
        "p99_ms": float(np.percentile(lat_ms, 99)),
        "bad_requests": out["bad"],
        "rss_start_gib": rss_start,
        "rss_end_gib": rss_end,
        "rss_drift_pct": 100 * (rss_end - rss_start) / rss_start,
    }


def make_batches(queries: list[str], batch_size: int) -> list[list[str]]:
    """Consecutive batches of ``batch_size`` queries (cycling when there are too few)."""
    repeated = queries * -(-batch_size // len(queries))
    return [
        repeated[i : i + batch_size] for i in range(0, len(repeated) - batch_size + 1, batch_size)
    ]


def measure_cell(
    url: str, queries: list[str], concurrency: int, batch_size: int, duration_s: float
) -> LoadCell:
    batches = make_batches(queries, batch_size)
    start = time.perf_counter()
    latencies, num_queries, num_errors = asyncio.run(
        closed_loop(url, batches, concurrency, duration_s)
    )
    elapsed = time.perf_counter() - start
    lat_ms = np.array(latencies) * 1000
    return LoadCell(
        concurrency=concurrency,
        batch_size=batch_size,
        duration_s=round(elapsed, 2),
        num_requests=len(latencies),
        num_queries=num_queries,
        num_errors=num_errors,
        queries_per_s=num_queries / elapsed,
        p50_ms=float(np.percentile(lat_ms, 50)),
        p99_ms=float(np.percentile(lat_ms, 99)),
    )


def process_rss_gib(pid: int) -> float:
    """RSS of a process and its children (uvicorn workers), GiB."""
    import psutil

    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs) / 2**30


# ------------------------------------------------------------------------------ in-process


def inprocess_bm25s_qps(model, queries: list[str], batch_size: int, min_s: float = 5.0) -> float:
    """bm25s's own pipeline on the same index: tokenize + retrieve, k=3, one thread."""
    import Stemmer

    bm25s = import_bm25s()

    stemmer = Stemmer.Stemmer("english")
    batches = make_batches(queries, batch_size)
    done, start, i = 0, time.perf_counter(), 0
    while time.perf_counter() - start < min_s:
        batch = batches[i % len(batches)]
        tokens = bm25s.tokenize(batch, stopwords="en", stemmer=stemmer, show_progress=False)
        model.retrieve(tokens, k=3, show_progress=False, n_threads=0)
        done += len(batch)
        i += 1
    return done / (time.perf_counter() - start)


def inprocess_retriever_qps(
    retriever, queries: list[str], batch_size: int, min_s: float = 5.0
) -> float:
    """The server's own BM25Retriever called in-process (what HTTP adds on top of it)."""
    batches = make_batches(queries, batch_size)
    done, start, i = 0, time.perf_counter(), 0
    while time.perf_counter() - start < min_s:
        batch = batches[i % len(batches)]
        retriever.search(batch, 3)
        done += len(batch)
        i += 1
    return done / (time.perf_counter() - start)


def rank_bm25_baseline(contents: list[str], queries: list[str], num_queries: int) -> dict:
    """``rank_bm25.BM25Okapi`` over the same stemmed tokens; build time and queries/s."""
    import Stemmer
    from rank_bm25 import BM25Okapi

    bm25s = import_bm25s()
    stemmer = Stemmer.Stemmer("english")
    start = time.perf_counter()
    corpus_tokens = bm25s.tokenize(
        contents, stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False
    )
    model = BM25Okapi(corpus_tokens)
    build_s = time.perf_counter() - start
    del corpus_tokens
    sample = queries[:num_queries]
    query_tokens = bm25s.tokenize(
        sample, stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False
    )
    start = time.perf_counter()
    for tokens in query_tokens:
        scores = model.get_scores(tokens)
        np.argpartition(-scores, 3)[:3]
    elapsed = time.perf_counter() - start
    return {"build_s": build_s, "num_queries": len(sample), "queries_per_s": len(sample) / elapsed}


def recall_at_3(
    retriever, queries: list[str], golds: list[list[str]], batch_size: int = 64
) -> float:
    from actors.scoring import normalize_answer

    hits = 0
    for start in range(0, len(queries), batch_size):
        results = retriever.search(queries[start : start + batch_size], 3)
        for result, gold in zip(results, golds[start : start + batch_size], strict=True):
            texts = [
                " " + normalize_answer(retriever.passages.contents[i]) + " "
                for i in result.passage_indices
            ]
            wanted = [" " + normalize_answer(g) + " " for g in gold if normalize_answer(g)]
            hits += any(w in t for w in wanted for t in texts)
    return hits / len(queries)


# ------------------------------------------------------------------------------ table


def markdown(report: Report) -> str:
    ratio_base = report.inprocess_bm25s_qps
    lines = [
        f"Corpus: {report.num_passages:,} passages. Server: bm25, {report.workers} uvicorn worker(s), "
        f"load {report.server_load_s:.2f} s, RSS {report.server_rss_gib:.2f} GiB.",
        "Index builds: "
        + ", ".join(
            f"{m} {v['build_time_s']:.1f} s / {v['index_bytes'] / 2**20:.0f} MiB / peak RSS {v['peak_rss_gib']:.2f} GiB"
            for m, v in report.index.items()
        ),
        "",
        "| concurrency | batch | queries/s | p50 ms | p99 ms | requests | errors "
        "| / in-process bm25s | / in-process server retriever |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report.load:
        base = ratio_base.get(c.batch_size, float("nan"))
        own = report.inprocess_server_retriever_qps.get(c.batch_size, float("nan"))
        lines.append(
            f"| {c.concurrency} | {c.batch_size} | {c.queries_per_s:.0f} | {c.p50_ms:.1f} "
            f"| {c.p99_ms:.1f} | {c.num_requests} | {c.num_errors} | {c.queries_per_s / base:.2f}x "
            f"| {c.queries_per_s / own:.2f}x |"
        )
    lines += [
        "",
        "| in-process baseline (same queries, k=3, 1 thread) | queries/s |",
        "|---|---:|",
    ]
    for b, qps in report.inprocess_bm25s_qps.items():
        lines.append(f"| bm25s (tokenize + retrieve), batch {b} | {qps:.0f} |")
    for b, qps in report.inprocess_server_retriever_qps.items():
        lines.append(f"| server's BM25Retriever (no HTTP), batch {b} | {qps:.0f} |")
    rb = report.rank_bm25
    if rb:
        lines.append(
            f"| rank_bm25 BM25Okapi ({rb['num_queries']}-query subsample; build {rb['build_s']:.0f} s) "
            f"| {rb['queries_per_s']:.1f} |"
        )
    lines += [
        "",
        "| recall@3 | " + " | ".join(report.recall_at_3) + " |",
        "|---|" + "---:|" * len(report.recall_at_3),
    ]
    for qa_set, n in report.recall_questions.items():
        cells = " | ".join(f"{report.recall_at_3[m][qa_set]:.3f}" for m in report.recall_at_3)
        lines.append(f"| {qa_set} (n={n}) | {cells} |")
    s = report.soak
    if s:
        lines += [
            "",
            f"Soak: {s['duration_s']:.0f} s at concurrency 64, batch 1: {s['num_requests']} requests, "
            f"{s['num_errors']} errors, {s['queries_per_s']:.0f} queries/s, p99 {s['p99_ms']:.1f} ms, "
            f"server RSS {s['rss_start_gib']:.3f} -> {s['rss_end_gib']:.3f} GiB ({s['rss_growth_pct']:+.2f}%).",
        ]
    h = report.hostile_soak
    if h:
        lines += ["", hostile_line(h)]
    lines += ["", *report.notes] if report.notes else []
    return "\n".join(lines)


def hostile_line(h: dict) -> str:
    """One markdown paragraph for the hostile soak."""
    bad = "; ".join(
        f"{kind} " + ", ".join(f"{k} x{v}" for k, v in sorted(got.items()))
        for kind, got in h["bad_requests"].items()
    )
    return (
        f"Hostile soak: {h['duration_s']:.0f} s at concurrency 64, every 5th request bad: "
        f"{h['valid_requests']} real queries, {h['valid_errors']} errors on them, "
        f"{h['queries_per_s']:.0f} queries/s, p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms; "
        f"bad requests answered: {bad}; server RSS {h['rss_start_gib']:.3f} -> "
        f"{h['rss_end_gib']:.3f} GiB ({h['rss_drift_pct']:+.2f}%)."
    )


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=ROOT / "data")
    parser.add_argument("--cell-s", type=float, default=8.0, help="Seconds per load cell.")
    parser.add_argument("--soak-s", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--recall-questions", type=int, default=500, help="Per QA set.")
    parser.add_argument("--rank-bm25-queries", type=int, default=100)
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument(
        "--hostile-soak-only",
        action="store_true",
        help="Run only the hostile soak (bad-input mix, --soak-s seconds) and print it.",
    )
    parser.add_argument(
        "--json-out", type=Path, default=ROOT / "artifacts/benchmarks/retrieval.json"
    )
    args = parser.parse_args()

    config = RetrievalServerConfig(
        corpus_path=args.data_dir / "corpus/passages.jsonl",
        index_dir=args.data_dir / "index",
        port=0,
        workers=args.workers,
        log_level="warning",
    )
    report = Report(workers=args.workers)
    rng = random.Random(0)
    qa = {name: read_qa(args.data_dir / "qa", name) for name in QA_SETS}
    load_queries = [query_and_golds(r)[0] for name in QA_SETS for r in qa[name]]
    rng.shuffle(load_queries)
    load_queries = load_queries[:4096]

    for method in ("bm25", "dense"):
        manifest = config.index_dir / method / "manifest.json"
        if manifest.is_file():
            report.index[method] = json.loads(manifest.read_text())

    log_path = ROOT / ".cache/retrieval/bench_server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(config, log_path)
    try:
        metrics = httpx.get(server.url + "/metrics").text
        report.server_load_s = float(
            re.search(r"^stppo_retrieval_index_load_seconds (\S+)", metrics, re.M).group(1)
        )
        report.num_passages = int(
            float(re.search(r"^stppo_retrieval_index_passages (\S+)", metrics, re.M).group(1))
        )
        measure_cell(server.url, load_queries, 4, 1, 2.0)  # warm up (page in the mmap'd index)
        if args.hostile_soak_only:
            report.hostile_soak = hostile_soak(server, load_queries, args.soak_s)
            print(json.dumps(report.hostile_soak), flush=True)
            print(hostile_line(report.hostile_soak))
            return
        for batch_size in (1, 32):
            for concurrency in (1, 16, 64):
                cell = measure_cell(server.url, load_queries, concurrency, batch_size, args.cell_s)
                report.load.append(cell)
                print(asdict(cell), flush=True)
        report.server_rss_gib = process_rss_gib(server.process.pid)
        rss_start = report.server_rss_gib
        soak = measure_cell(server.url, load_queries, 64, 1, args.soak_s)
        rss_end = process_rss_gib(server.process.pid)
        report.soak = {
            **asdict(soak),
            "rss_start_gib": rss_start,
            "rss_end_gib": rss_end,
            "rss_growth_pct": 100 * (rss_end - rss_start) / rss_start,
        }
        print(report.soak, flush=True)
        report.hostile_soak = hostile_soak(server, load_queries, args.soak_s)
        print(report.hostile_soak, flush=True)
    finally:
        stop_server(server)

    bm25_loaded = load_retriever(config.model_copy(update={"method": "bm25"}))
    model = bm25_loaded.retriever._model
    report.inprocess_bm25s_qps = {b: inprocess_bm25s_qps(model, load_queries, b) for b in (1, 32)}
    print("in-process bm25s", report.inprocess_bm25s_qps, flush=True)
    report.inprocess_server_retriever_qps = {
        b: inprocess_retriever_qps(bm25_loaded.retriever, load_queries, b) for b in (1, 32)
    }
    print("in-process BM25Retriever", report.inprocess_server_retriever_qps, flush=True)
    report.notes.append(
        f"rank_bm25 measured on the first {args.rank_bm25_queries} queries only: it scores every "
        "passage in numpy for each query term."
    )
    report.rank_bm25 = rank_bm25_baseline(
        bm25_loaded.retriever.passages.contents, load_queries, args.rank_bm25_queries
    )
    print("rank_bm25", report.rank_bm25, flush=True)

    retrievers = {"bm25": bm25_loaded.retriever}
    dense_manifest = config.index_dir / "dense" / "manifest.json"
    if not args.skip_dense and not dense_manifest.is_file():
        partial = sorted(config.index_dir.glob("dense.partial-*/chunk_*.npy"))
        report.notes.append(
            f"dense/hybrid recall not measured: no dense index yet ({len(partial)} chunks of "
            "2048 passages encoded; build with `python -m retrieval_server --method dense "
            "--build-only --build-lock .cache/heavy.lock`)"
        )
        args.skip_dense = True
    if not args.skip_dense:
        hybrid = load_retriever(
            config.model_copy(update={"method": "hybrid", "torch_threads": 2})
        ).retriever
        retrievers["dense"] = hybrid._dense
        retrievers["hybrid"] = hybrid
    for method, retriever in retrievers.items():
        report.recall_at_3[method] = {}
        for name in QA_SETS:
            sample = qa[name][: args.recall_questions]
            pairs = [query_and_golds(r) for r in sample]
            report.recall_questions[name] = len(pairs)
            report.recall_at_3[method][name] = recall_at_3(
                retriever, [q for q, _ in pairs], [g for _, g in pairs]
            )
        print(
            "recall@3",
            method,
            report.recall_at_3[method],
            f"process RSS {rss_gib():.2f} GiB",
            flush=True,
        )

    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(asdict(report), indent=2, default=str))
    print()
    print(markdown(report))
    print(f"\nOne run; raw numbers in {args.json_out}")


if __name__ == "__main__":
    main()
