"""``stppo prepare-synthetic``: a synthetic multi-turn search task and a tiny policy for it.

The stability benchmark (``stppo experiment stability``, :mod:`experiments.stability`) runs the
real pipeline (driver, rollout actors, buffer, DeepSpeed learner, retrieval server, weight
sync) on this task, so that one RL step takes about a second on a 2-core CPU. Everything is
built from a seed, in the formats of the real assets (:mod:`prepare`), under
``data/synthetic/``:

- ``corpus/passages.jsonl``: one passage per record (Search-R1 ``{"id", "contents"}``,
  contents ``"<ID>"\\nRecord <ID>: the access code is <CODE>; it links to record <LINK>.``),
  ids one capital letter and 4 digits (``K4821``), codes 3 digits, links to another record;
- ``qa/single_hop/{train,validation,test}.jsonl``: "What is the access code of record
  K4821?" (one search: ``K4821``); ``qa/multi_hop/...``: "Record K4821 links to another
  record. What is the access code of that record?" (two searches: ``K4821``, then the
  linked id; ``metadata.partial_answer`` is K4821's own code, what stopping after the
  first search would answer). Records (not questions) are split 80/10/10, so validation and test ask about
  records no training question names. Scored by exact match (:mod:`actors.reward`);
- ``index/bm25``: the retrieval server's BM25 index (built by
  :func:`retrieval_server.index.build_index`); the record's id is its title, so it ranks
  first for its own id, and the records linking to it follow (distractors);
- ``model/tiny-llama``: an ``LlamaForCausalLM`` made from scratch (random init, seeded),
  with a byte-level BPE tokenizer trained on this corpus and its prompts (digits split one
  per token, ChatML special tokens at the SmolLM2 ids 0/1/2 and its chat template); every
  record id and every code is one token of its own.

Why it suits the benchmark: the warm-start SFT (:mod:`learner.sft`) teaches the format and
copying (1,536 steps on 3,072 training questions in the stability grid: validation
success 0.25-0.56 after it, depending on the run); validation asks about ids the warm start
never showed, and two-hop questions need the second search, so RL has room to improve.
The task's config (``deploy/configs/synthetic.toml``) uses a one-line
``rollout.system_prompt`` and top-1 retrieval: behind Search-R1's ~140-token instruction
this model learned the format but copied no id in 600 SFT steps.

Example::

    report = build_synthetic(Path("data/synthetic"))
    print(report.summary)
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from learner.config import StrictModel

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""SmolLM2's ChatML chat template (same special tokens)."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Special tokens at ids 0, 1, 2 (unk, bos, eos), as in SmolLM2."""

MODEL_NAME = "tiny-llama"
"""Folder name of the policy under ``<data_dir>/model``."""

TASK_VERSION = 2
"""Version of what a build contains, beside its spec (2: two-hop questions name the first
record's code as ``metadata.partial_answer``); a build of another version is rebuilt."""

MANIFEST = "manifest.json"
"""Written last: its presence (with a matching spec) marks a complete build."""


class SyntheticSpec(StrictModel):
    """What :func:`build_synthetic` builds (recorded in ``manifest.json``)."""

    seed: int = Field(0, ge=0)
    """Seed of records, splits, tokenizer corpus order and model initialisation."""

    num_records: int = Field(2000, ge=20, le=200_000)
    """Records in the corpus (one passage each)."""

    vocab_size: int = Field(1024, ge=300, le=32_000)
    """Target size of the byte-level BPE vocabulary (256 bytes + merges + 3 special)."""

    hidden_size: int = Field(128, ge=16, le=4096)
    """Width of the Llama model."""

    num_layers: int = Field(4, ge=1, le=64)
    """Decoder layers."""

    num_heads: int = Field(4, ge=1, le=64)
    """Attention heads (head dim = hidden_size / num_heads)."""

    intermediate_size: int = Field(512, ge=16, le=16384)
    """MLP width."""

    max_positions: int = Field(1024, ge=128, le=32768)
    """Longest sequence (prompt + response tokens)."""


@dataclass(frozen=True)
class SyntheticReport:
    """Outcome of :func:`build_synthetic`.

    Attributes:
        data_dir: the task folder.
        built: True when this call built it; False when an existing build matched.
        num_records: passages in the corpus.
        num_questions: ``{dataset: {split: count}}``.
        num_params: parameters of the policy (tied embeddings counted once).
        vocab_size: tokenizer size.
        elapsed_s: wall time, seconds.
    """

    data_dir: Path
    built: bool
    num_records: int
    num_questions: dict[str, dict[str, int]]
    num_params: int
    vocab_size: int
    elapsed_s: float

    @property
    def summary(self) -> str:
        """One line for the command's output."""
        qs = ", ".join(f"{d} {sum(s.values())}" for d, s in self.num_questions.items())
        verb = "built" if self.built else "up to date (manifest matches)"
        return (
            f"synthetic task {verb} in {self.elapsed_s:.1f} s: {self.num_records} records, "
            f"questions {qs}, policy {self.num_params:,} params, vocab {self.vocab_size}"
        )


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class SyntheticRecord:
    """One record of the corpus: its id, access code and the id it links to."""

    rid: str
    code: str
    link: str

    @property
    def text(self) -> str:
        """The passage text (without the title line)."""
        return f"Record {self.rid}: the access code is {self.code}; it links to record {self.link}."


def make_records(num_records: int, seed: int) -> list[SyntheticRecord]:
    """``num_records`` records with unique ids (``[A-Z][0-9]{4}``), 3-digit codes, and a
    link to another record (never itself), all from ``random.Random(seed)``."""
    rng = random.Random(seed)
    ids: list[str] = []
    seen: set[str] = set()
    while len(ids) < num_records:
        rid = f"{rng.choice('ABCDEFGHJKLMNPRSTUVWXYZ')}{rng.randrange(10_000):04d}"
        if rid not in seen:
            seen.add(rid)
            ids.append(rid)
    records = []
    for i, rid in enumerate(ids):
        j = rng.randrange(num_records - 1)
        link = ids[j if j < i else j + 1]
        records.append(SyntheticRecord(rid, f"{rng.randrange(1000):03d}", link))
    return records


def passage(record: SyntheticRecord, index: int) -> dict[str, str]:
    """Search-R1 passage of one record: the id as the title line, then the text."""
    return {"id": str(index), "contents": f'"{record.rid}"\n{record.text}'}


def one_hop_question(record: SyntheticRecord) -> str:
    """Question answered by one search for ``record.rid``."""
    return f"What is the access code of record {record.rid}?"


def two_hop_question(record: SyntheticRecord) -> str:
    """Question answered by a search for ``record.rid``, then one for its link."""
    return f"Record {record.rid} links to another record. What is the access code of that record?"


def qa_records(records: list[SyntheticRecord], seed: int) -> dict[str, dict[str, list[dict]]]:
    """``{"single_hop" | "multi_hop": {split: [QA record]}}`` in the real QA format
    (:func:`prepare.qa.make_record`); records split 80/10/10 by a seeded shuffle."""
    from prepare.qa import make_record

    by_id = {r.rid: r for r in records}
    index = {r.rid: i for i, r in enumerate(records)}
    order = list(range(len(records)))
    random.Random(seed + 1).shuffle(order)
    n_train, n_val = int(0.8 * len(order)), int(0.1 * len(order))
    splits = {
        "train": order[:n_train],
        "validation": order[n_train : n_train + n_val],
        "test": order[n_train + n_val :],
    }
    out: dict[str, dict[str, list[dict]]] = {"single_hop": {}, "multi_hop": {}}
    for split, idx in splits.items():
        one, two = [], []
        for i in idx:
            r = records[i]
            linked = by_id[r.link]
            one.append(make_record(
                "single_hop", "code", r.rid, one_hop_question(r), [r.code], r.rid, [r.rid],
                str(index[r.rid]),
            ))  # fmt: skip
            two.append(make_record(
                "multi_hop", "linked_code", r.rid, two_hop_question(r), [linked.code], r.rid,
                [r.rid, linked.rid], str(index[linked.rid]), bridge=linked.rid,
                partial_answer=r.code,
            ))  # fmt: skip
        out["single_hop"][split] = one
        out["multi_hop"][split] = two
    return out


# --------------------------------------------------------------------------- tokenizer/model


def tokenizer_texts(
    records: list[SyntheticRecord], qa: dict[str, dict[str, list[dict]]]
) -> list[str]:
    """What the tokenizer is trained on: passages, questions, the agent's system prompt and
    the demonstration turns (so the tags become single tokens)."""
    from actors.demonstrations import ANSWER_THOUGHT, SEARCH_THOUGHT
    from actors.prompts import SYSTEM_PROMPT

    texts = [SYSTEM_PROMPT] * 50
    for r in records:
        texts.append(f"Doc 1 (Title: {r.rid}) {r.text}")
        texts.append(SEARCH_THOUGHT.format(query=r.rid))
        texts.append(ANSWER_THOUGHT.format(answer=r.code))
        texts.append("\n\n<information>" + r.text + "</information>\n\n")
    for sets in qa.values():
        for recs in sets.values():
            texts.extend(q["question"] for q in recs)
    return texts


def train_tokenizer(texts: list[str], vocab_size: int, whole_words: list[str] = ()):
    """Byte-level BPE (digits one per token) with ChatML specials at ids 0-2, as a
    ``PreTrainedTokenizerFast`` carrying :data:`CHATML_TEMPLATE`. ``whole_words`` (the record
    ids and the codes) become one token each (added tokens, matched before the BPE), so
    the policy copies one token, not five digits: a 4-layer model trained from scratch
    for a few hundred SFT steps learned the format but copied no id digit by digit."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(w, normalized=False) for w in whole_words])
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[2],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_model(spec: SyntheticSpec, vocab_size: int, out_dir: Path) -> int:
    """A randomly initialised ``LlamaForCausalLM`` (``torch.manual_seed(spec.seed)``, fp32,
    tied embeddings) saved to ``out_dir``; returns its parameter count."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- build


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def _read_manifest(data_dir: Path) -> dict | None:
    try:
        return json.loads((data_dir / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def build_synthetic(
    data_dir: Path = Path("data/synthetic"), spec: SyntheticSpec | None = None, force: bool = False
) -> SyntheticReport:
    """Build the task folder (module docstring) into a temporary folder, then rename it into
    place; an existing folder whose ``manifest.json`` records the same spec is kept unless
    ``force``. Same spec, same files (seeded), except the index's timestamps.

    Raises:
        RuntimeError: the tokenizer lost the SmolLM2 special-token ids.
        retrieval_server.passages.CorpusError: the written corpus does not load.
    """
    from retrieval_server.config import RetrievalServerConfig
    from retrieval_server.index import build_index

    spec = spec or SyntheticSpec()
    start = time.perf_counter()
    manifest = _read_manifest(data_dir)
    if (
        manifest is not None
        and manifest.get("spec") == spec.model_dump()
        and manifest.get("task_version") == TASK_VERSION
        and not force
    ):
        return SyntheticReport(
            data_dir, False, manifest["num_records"], manifest["num_questions"],
            manifest["num_params"], manifest["vocab_size"], time.perf_counter() - start,
        )  # fmt: skip
    tmp = data_dir.with_name(data_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    records = make_records(spec.num_records, spec.seed)
    _write_jsonl(tmp / "corpus" / "passages.jsonl", [passage(r, i) for i, r in enumerate(records)])
    qa = qa_records(records, spec.seed)
    for name, splits in qa.items():
        for split, rows in splits.items():
            _write_jsonl(tmp / "qa" / name / f"{split}.jsonl", rows)
    build_index(
        RetrievalServerConfig(
            method="bm25", corpus_path=tmp / "corpus" / "passages.jsonl", index_dir=tmp / "index"
        )
    )
    whole = sorted({r.rid for r in records}) + [f"{c:03d}" for c in range(1000)]
    tokenizer = train_tokenizer(tokenizer_texts(records, qa), spec.vocab_size, whole)
    model_dir = tmp / "model" / MODEL_NAME
    tokenizer.save_pretrained(model_dir)
    num_params = build_model(spec, len(tokenizer), model_dir)
    counts = {n: {s: len(rows) for s, rows in splits.items()} for n, splits in qa.items()}
    manifest = {
        "spec": spec.model_dump(),
        "task_version": TASK_VERSION,
        "num_records": len(records),
        "num_questions": counts,
        "num_params": num_params,
        "vocab_size": len(tokenizer),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if data_dir.exists():
        shutil.rmtree(data_dir)
    tmp.rename(data_dir)
    return SyntheticReport(
        data_dir, True, len(records), counts, num_params, len(tokenizer),
        time.perf_counter() - start,
    )  # fmt: skip
