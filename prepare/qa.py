"""QA sets in Search-R1 format, generated from the same sources as the corpus.

Three sets, each written to ``data/qa/<set>/{train,validation,test}.jsonl``:

- ``single_hop`` (NQ-like): one fact about one entity (Factbook country facts, airport
  IATA codes, city -> country, city population, Wikipedia lead sentence -> title, element
  discoverer/year/symbol).
- ``multi_hop`` (HotpotQA-like bridges): city/airport -> country -> Factbook fact, and
  disease -> gene -> cytogenetic band. The question names only the first entity, so one
  search rarely finds the answer passage; a second search on the bridge entity does.
- ``medical_mc`` (MedQA-like, options A-D): vignette -> diagnosis, disease -> gene,
  inheritance mode (class-balanced), HPO definition -> term, ICD-10-CM code ->
  description, essential medicine -> class. Items are admitted only while the
  "longest option" and "most word overlap with the question" heuristics stay at chance.

Record (one JSON object per line)::

    {"id": str, "question": str, "golden_answers": [str, ...],
     "data_source": "single_hop" | "multi_hop" | "medical_mc",
     "metadata": {"entity": str, "search_queries": [str, ...], "type": str,
                  "answer_passage_id": str, ...}}

Splits are by ``metadata.entity`` through a hash (:func:`split_of`), the same function for
every set, so an entity is in exactly one split everywhere.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from actors.scoring import normalize_answer
from prepare import sources as S
from prepare.corpus import (
    Sources,
    country_answer_aliases,
    country_display_name,
    iso_to_country_name,
    load_sources,
    slug,
)
from prepare.manifest import read_manifest

if TYPE_CHECKING:
    from retrieval_server.retrievers import BM25Retriever

BUILD_VERSION = 2
"""Bump when the generated records change; a built ``qa/`` of another version is rebuilt."""
SETS = ("single_hop", "multi_hop", "medical_mc")
SPLITS = ("train", "validation", "test")
SPLIT_PERCENT = {"train": 80, "validation": 10, "test": 10}
SEED = 20251122
LETTERS = ("A", "B", "C", "D")
CHANCE = 0.25
HEURISTIC_TARGET = 0.25
"""Admission keeps each MC heuristic's running accuracy at or below this rate."""
GENERIC_ANSWER_MIN_COUNTRIES = 3
"""A Factbook answer shared by this many countries is generic ("National Assembly"): dropped."""

# Caps (keep one source or one country from dominating a set).
CAP_PER_COUNTRY_SINGLE = 60
CAP_PER_COUNTRY_FACT_MULTI = 10
CAP_DISEASE_GENE_BAND = 5000
CAP_WIKI = 5000
CAP_MC = {
    "vignette": 4000,
    "disease_gene": 3000,
    "inheritance": 2000,
    "definition": 3000,
    "icd10": 3000,
    "medicine": 400,
}


class QABuildError(RuntimeError):
    """A QA set could not be built to its contract (too few items, missing corpus...)."""


Record = dict


def split_of(entity: str) -> str:
    """Deterministic split for an entity: sha256 bucket 0-99 -> 80/10/10.

    Example::

        >>> split_of("France") in SPLITS
        True
    """
    bucket = int(hashlib.sha256(f"stppo-split:{entity}".encode()).hexdigest(), 16) % 100
    if bucket < SPLIT_PERCENT["train"]:
        return "train"
    if bucket < SPLIT_PERCENT["train"] + SPLIT_PERCENT["validation"]:
        return "validation"
    return "test"


def record_id(data_source: str, qtype: str, key: str) -> str:
    """Stable record id: ``<set>-<type>-<12 hex of sha256(key)>``."""
    return f"{data_source}-{qtype}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def make_record(
    data_source: str,
    qtype: str,
    key: str,
    question: str,
    answers: Sequence[str],
    entity: str,
    search_queries: Sequence[str],
    answer_passage_id: str,
    **extra,
) -> Record:
    """Build one QA record (aliases deduplicated by normalised form, order kept).

    Raises:
        ValueError: no usable answer (all aliases normalise to ``""``) or no query.
    """
    seen, golden = set(), []
    for a in answers:
        # Option letters: "A" normalises to "" (an article), so fall back to the raw text.
        n = normalize_answer(a) if data_source != "medical_mc" else a.strip().upper()
        if n and n not in seen:
            seen.add(n)
            golden.append(a.strip())
    if not golden:
        raise ValueError(f"record {key!r}: no usable golden answer in {list(answers)!r}")
    if not search_queries:
        raise ValueError(f"record {key!r}: no search query")
    return {
        "id": record_id(data_source, qtype, key),
        "question": question,
        "golden_answers": golden,
        "data_source": data_source,
        "metadata": {
            "entity": entity,
            "search_queries": list(search_queries),
            "type": qtype,
            "answer_passage_id": answer_passage_id,
            **extra,
        },
    }


def _contains(text: str, needle: str) -> bool:
    n = normalize_answer(needle)
    return bool(n) and f" {n} " in f" {normalize_answer(text)} "


def _aliases_from_parens(value: str) -> list[str]:
    """``"Tashkent (Toshkent)"`` -> ``["Tashkent", "Toshkent"]``."""
    main = " ".join(re.sub(r"\([^)]*\)", " ", value).split())
    inner = [x.strip() for x in re.findall(r"\(([^)]*)\)", value)]
    return [main, *[x for x in inner if x and x[0].isupper() and len(x.split()) <= 4]]


# ---------------------------------------------------------------- Factbook facts


@dataclass(frozen=True)
class FactSpec:
    """A Factbook fact usable as an answer.

    Attributes:
        name: short type name (``capital``...).
        path: keys into the Factbook JSON.
        relation: noun phrase for questions ("the capital").
        query: words for the demonstrator's search query ("capital").
        extract: raw text -> list of aliases (first = main answer), or ``[]`` to skip.
    """

    name: str
    path: tuple[str, ...]
    relation: str
    query: str
    extract: Callable[[str], list[str]]


def _capital(text: str) -> list[str]:
    main = _aliases_from_parens(text)
    return [] if not main[0] or "," in main[0] or ";" in main[0] else main


def _elevation_point(text: str) -> list[str]:
    m = re.match(r"^(.*?)\s+-?[\d,.]+\s*(m)?$", text)
    name = m.group(1) if m else ""
    if not name or name.lower() in ("unnamed location", "sea level") or ";" in name:
        return []
    return [a for a in _aliases_from_parens(name) if a]


def _anthem(text: str) -> list[str]:
    m = re.match(r'^"([^"]+)"', text)
    if not m:
        return []
    inner = re.findall(r"\(([^)]*)\)", text[m.end() :])
    return [m.group(1), *[x for x in inner[:1] if len(x.split()) <= 8]]


def _legislature(text: str) -> list[str]:
    return _aliases_from_parens(text) if text and ";" not in text else []


def _independence(text: str) -> list[str]:
    m = re.match(r"^(\d{1,2} [A-Z][a-z]+ \d{3,4})\b", text)
    return [m.group(1)] if m else []


def _tld(text: str) -> list[str]:
    m = re.fullmatch(r"\.([a-z]{2})", text.strip())
    return [f".{m.group(1)}", m.group(1)] if m else []


def _currency(text: str) -> list[str]:
    m = re.match(r"^(?:Currency: )?([A-Za-z][A-Za-z .'-]+?) \(([A-Z]{3})\)", text)
    if not m:
        return []
    name = m.group(1).strip()
    singular = re.sub(r"s$", "", name.split(" per ")[0])
    return [name, singular, m.group(2)]


FACTS = (
    FactSpec(
        "capital", ("Government", "Capital", "name", "text"), "the capital", "capital", _capital
    ),
    FactSpec(
        "highest_point",
        ("Geography", "Elevation", "highest point", "text"),
        "the highest point",
        "highest point elevation",
        _elevation_point,
    ),
    FactSpec(
        "lowest_point",
        ("Geography", "Elevation", "lowest point", "text"),
        "the lowest point",
        "lowest point elevation",
        _elevation_point,
    ),
    FactSpec(
        "anthem",
        ("Government", "National anthem(s)", "title", "text"),
        "the national anthem",
        "national anthem",
        _anthem,
    ),
    FactSpec(
        "legislature",
        ("Government", "Legislative branch", "legislature name", "text"),
        "the name of the legislature",
        "legislature name",
        _legislature,
    ),
    FactSpec(
        "independence",
        ("Government", "Independence", "text"),
        "the independence date",
        "independence",
        _independence,
    ),
    FactSpec(
        "internet_code",
        ("Communications", "Internet country code", "text"),
        "the internet country code",
        "internet country code",
        _tld,
    ),
    FactSpec(
        "currency",
        ("Economy", "Exchange rates", "Currency", "text"),
        "the currency",
        "exchange rates currency",
        _currency,
    ),
)

_FACT_QUESTION = {
    "capital": "What is the capital of {x}?",
    "highest_point": "What is the highest point of {x}?",
    "lowest_point": "What is the lowest point of {x}?",
    "anthem": "What is the title of the national anthem of {x}?",
    "legislature": "What is the name of the legislature of {x}?",
    "independence": "On what date did {x} become independent?",
    "internet_code": "What is the internet country code of {x}?",
    "currency": "What is the currency of {x}?",
}


@dataclass(frozen=True)
class CountryFact:
    """One extracted Factbook fact with the id of the passage that states it."""

    code: str
    country: str
    spec: FactSpec
    answers: list[str]
    passage_id: str


def _passage_with(passages: dict[str, str], prefix: str, answer: str) -> str | None:
    """First chunk ``prefix:k`` whose contents contain ``answer`` (normalised)."""
    k = 0
    while (pid := f"{prefix}:{k}") in passages:
        if _contains(passages[pid], answer):
            return pid
        k += 1
    return None


def country_facts(factbook: list[S.FactbookCountry], passages: dict[str, str]) -> list[CountryFact]:
    """Facts per country for :data:`FACTS`, dropping generic answers (shared by
    ``GENERIC_ANSWER_MIN_COUNTRIES`` or more countries) and facts whose passage is missing."""
    raw: list[CountryFact] = []
    for c in factbook:
        name = country_display_name(c.name)
        for spec in FACTS:
            text = c.text(*spec.path)
            answers = spec.extract(text) if text else []
            if not answers:
                continue
            prefix = f"factbook:{c.code}:{slug(spec.path[0])}/{slug(spec.path[1])}"
            pid = _passage_with(passages, prefix, answers[0])
            if pid is not None:
                raw.append(CountryFact(c.code, name, spec, answers, pid))
    shared = Counter((f.spec.name, normalize_answer(f.answers[0])) for f in raw)
    return [
        f
        for f in raw
        if shared[(f.spec.name, normalize_answer(f.answers[0]))] < GENERIC_ANSWER_MIN_COUNTRIES
    ]


# ---------------------------------------------------------------- single hop


def _unique_by(items: Iterable, key: Callable) -> list:
    counts = Counter(normalize_answer(key(x)) for x in items)
    return [x for x in items if counts[normalize_answer(key(x))] == 1]


def single_hop_records(
    src: Sources, passages: dict[str, str], facts: list[CountryFact]
) -> list[Record]:
    """NQ-like one-fact questions (see module docstring), capped per country."""
    out: list[Record] = []
    ds = "single_hop"
    for f in facts:
        q = _FACT_QUESTION[f.spec.name].format(x=f.country)
        out.append(
            make_record(
                ds,
                f"factbook_{f.spec.name}",
                f"{f.code}:{f.spec.name}",
                q,
                f.answers,
                f.country,
                [f"{f.country} {f.spec.query}"],
                f.passage_id,
                country=f.country,
            )
        )
    iso_names = iso_to_country_name(src.factbook, src.geo_countries)
    per_country: Counter = Counter()

    def admit(country: str, qtype: str) -> bool:
        per_country[(country, qtype)] += 1
        return per_country[(country, qtype)] <= CAP_PER_COUNTRY_SINGLE

    airports = _unique_by([a for a in src.airports if a.iata and a.city], lambda a: a.name)
    iata_counts = Counter(a.iata for a in src.airports if a.iata)
    for a in airports:
        country = iso_names.get(a.country_iso, a.country_iso)
        pid = f"airports:{a.icao}:0"
        short = re.sub(r"\s+(International\s+)?Airport$", "", a.name)
        if iata_counts[a.iata] == 1 and admit(country, "airport_by_iata"):
            out.append(
                make_record(
                    ds,
                    "airport_by_iata",
                    a.icao,
                    f"Which airport has the IATA code {a.iata}?",
                    [a.name, short],
                    f"airport:{a.icao}",
                    [f"IATA code {a.iata} airport"],
                    pid,
                    country=country,
                )
            )
        if admit(country, "airport_iata_code"):
            out.append(
                make_record(
                    ds,
                    "airport_iata_code",
                    a.icao,
                    f"What is the IATA code of {a.name}?",
                    [a.iata],
                    f"airport:{a.icao}",
                    [f"{a.name} IATA code"],
                    pid,
                    country=country,
                )
            )
    cities = _unique_by(src.cities, lambda c: c.name)
    for c in cities:
        country_iso = c.country_iso
        country = iso_names.get(country_iso, country_iso)
        pid = f"geonames:{c.geonameid}:0"
        geo_name = next((g.name for g in src.geo_countries if g.iso == country_iso), "")
        if admit(country, "city_country"):
            out.append(
                make_record(
                    ds,
                    "city_country",
                    str(c.geonameid),
                    f"In which country is the city of {c.name}?",
                    country_answer_aliases(country, geo_name),
                    f"city:{c.geonameid}",
                    [f"{c.name} city"],
                    pid,
                    country=country,
                )
            )
        if c.population >= 100_000 and admit(country, "city_population"):
            out.append(
                make_record(
                    ds,
                    "city_population",
                    str(c.geonameid),
                    f"What is the population of {c.name} according to GeoNames?",
                    [f"{c.population:,}", str(c.population)],
                    f"city:{c.geonameid}",
                    [f"{c.name} population"],
                    pid,
                    country=country,
                )
            )
    out += _wikipedia_records(src.wikipedia, passages)
    out += _element_records(src.elements)
    return out


def _wikipedia_records(articles: list[S.WikiArticle], passages: dict[str, str]) -> list[Record]:
    """Lead sentence with the title masked -> title (at most :data:`CAP_WIKI`)."""
    out = []
    for a in articles:
        first = re.split(r"(?<=[.!?])\s+", a.extract)[0]
        if not first.lower().startswith(a.title.lower()) or len(a.title) < 3:
            continue
        masked = re.sub(re.escape(a.title), "___", first, flags=re.IGNORECASE)
        if len(masked.split()) < 8 or len(masked.split()) > 45 or "___" not in masked:
            continue
        pid = f"wikipedia:{slug(a.title)}:0"
        if pid not in passages:
            continue
        out.append(
            make_record(
                "single_hop",
                "wikipedia_title",
                a.title,
                f'Which topic is described here: "{masked}"?',
                _aliases_from_parens(a.title),
                f"wiki:{a.title}",
                [masked.replace("___", "").strip()[:200]],
                pid,
            )
        )
    rng = random.Random(SEED)
    rng.shuffle(out)
    return sorted(out[:CAP_WIKI], key=lambda r: r["id"])


def _element_records(elements: list[S.Element]) -> list[Record]:
    out = []
    for e in elements:
        pid = f"elements:{e.atomic_number}:0"
        ent = f"element:{e.name}"
        out.append(
            make_record(
                "single_hop",
                "element_symbol",
                e.name,
                f"Which chemical element has the symbol {e.symbol}?",
                [e.name],
                ent,
                [f"element symbol {e.symbol}"],
                pid,
            )
        )
        if e.discoverers and len(e.discoverers.split()) <= 8:
            names = [x.strip() for x in re.split(r",| and ", e.discoverers) if x.strip()]
            out.append(
                make_record(
                    "single_hop",
                    "element_discoverer",
                    e.name,
                    f"Who discovered the chemical element {e.name}?",
                    [e.discoverers, *names],
                    ent,
                    [f"{e.name} element discovered"],
                    pid,
                )
            )
        if e.discovery_year:
            out.append(
                make_record(
                    "single_hop",
                    "element_year",
                    e.name,
                    f"In what year was the chemical element {e.name} discovered?",
                    [str(e.discovery_year)],
                    ent,
                    [f"{e.name} element discovered"],
                    pid,
                )
            )
    return out


# ---------------------------------------------------------------- multi hop


_MULTI_QUESTION = {
    "capital": "What is the capital of the country where {x} is located?",
    "highest_point": "What is the highest point of the country where {x} is located?",
    "lowest_point": "What is the lowest point of the country where {x} is located?",
    "anthem": "What is the title of the national anthem of the country where {x} is located?",
    "legislature": "What is the name of the legislature of the country where {x} is located?",
    "independence": "On what date did the country where {x} is located become independent?",
    "internet_code": "What is the internet country code of the country where {x} is located?",
    "currency": "What is the currency of the country where {x} is located?",
}


def multi_hop_records(
    src: Sources, facts: list[CountryFact], passages: dict[str, str]
) -> list[Record]:
    """Bridge questions: (city | airport) -> country -> fact; disease -> gene -> band.

    The question never contains the bridge entity or the answer (items where it would are
    skipped), and each (country, fact) pair is used at most
    :data:`CAP_PER_COUNTRY_FACT_MULTI` times, half via cities and half via airports.
    """
    iso_names = iso_to_country_name(src.factbook, src.geo_countries)
    by_country: dict[str, list[CountryFact]] = defaultdict(list)
    for f in facts:
        by_country[f.country].append(f)
    firsts: list[tuple[str, str, str, str, str]] = []  # (kind, key, country, mention, pid)
    for c in sorted(_unique_by(src.cities, lambda c: c.name), key=lambda c: -c.population):
        firsts.append(
            (
                "city",
                str(c.geonameid),
                iso_names.get(c.country_iso, ""),
                f"the city of {c.name}",
                f"geonames:{c.geonameid}:0",
            )
        )
    airports = _unique_by([a for a in src.airports if a.iata and a.city], lambda a: a.name)
    for a in airports:
        firsts.append(
            ("airport", a.icao, iso_names.get(a.country_iso, ""), a.name, f"airports:{a.icao}:0")
        )
    used: Counter = Counter()
    out: list[Record] = []
    for kind, key, country, mention, first_pid in firsts:
        for f in by_country.get(country, ()):
            slot = (country, f.spec.name, kind)
            if used[slot] >= CAP_PER_COUNTRY_FACT_MULTI // 2:
                continue
            q = _MULTI_QUESTION[f.spec.name].format(x=mention)
            if _contains(q, f.answers[0]) or _contains(q, country):
                continue
            used[slot] += 1
            first_query = mention.removeprefix("the city of ")
            out.append(
                make_record(
                    "multi_hop",
                    f"{kind}_country_{f.spec.name}",
                    f"{kind}:{key}:{f.spec.name}",
                    q,
                    f.answers,
                    country,
                    [
                        f"{first_query} {'city' if kind == 'city' else 'airport'} country",
                        f"{country} {f.spec.query}",
                    ],
                    f.passage_id,
                    bridge_entity=country,
                    first_passage_id=first_pid,
                    country=country,
                )
            )
    out += _disease_gene_band_records(src)
    return out


def _disease_gene_band_records(src: Sources) -> list[Record]:
    genes = {g.symbol: g for g in src.genes}
    out = []
    for d in src.diseases:
        if len(d.genes) != 1 or d.genes[0] not in genes:
            continue
        g = genes[d.genes[0]]
        if not g.location or _contains(d.name, g.symbol):
            continue
        q = f"On which cytogenetic band is the gene associated with {d.name} located?"
        out.append(
            make_record(
                "multi_hop",
                "disease_gene_band",
                d.id,
                q,
                [g.location],
                f"gene:{g.symbol}",
                [d.name, f"{g.symbol} gene"],
                f"hgnc:{g.hgnc_id or g.symbol}:0",
                bridge_entity=g.symbol,
                first_passage_id=f"disease:{d.id}:0",
            )
        )
    random.Random(SEED).shuffle(out)
    return sorted(out[:CAP_DISEASE_GENE_BAND], key=lambda r: r["id"])


# ---------------------------------------------------------------- medical MC


def _words(text: str) -> set[str]:
    return set(normalize_answer(text).split())


def longest_option_letter(options: dict[str, str]) -> str:
    """Letter of the longest option (characters; ties -> first letter)."""
    return max(LETTERS, key=lambda k: (len(options[k]), -LETTERS.index(k)))


def overlap_option_letter(stem: str, options: dict[str, str]) -> str:
    """Letter of the option sharing the most distinct normalised words with the question
    stem (ties -> first letter)."""
    stem_words = _words(stem)
    return max(LETTERS, key=lambda k: (len(stem_words & _words(options[k])), -LETTERS.index(k)))


@dataclass(frozen=True)
class McCandidate:
    """An MC item before option placement: stem, correct text, distractor pool."""

    qtype: str
    key: str
    stem: str
    correct: str
    distractors: tuple[str, ...]  # pool (>= 3), sampled from
    entity: str
    search_query: str
    answer_passage_id: str


class HeuristicBalancer:
    """Admit MC items so that the two answer-shape heuristics stay at chance.

    For each candidate it tries the correct letter in order of least use so far (keeps
    A-D balanced), and for each letter a few distractor samples; an item is admitted when
    adding it keeps the running accuracy of both heuristics (longest option, most overlap
    with the stem) at or below :data:`HEURISTIC_TARGET` (or the item is a miss for both),
    else it is dropped.
    """

    def __init__(self, rng: random.Random, tries: int = 4) -> None:
        self.rng = rng
        self.tries = tries
        self.n = 0
        self.longest_hits = 0
        self.overlap_hits = 0
        self.letter_counts = dict.fromkeys(LETTERS, 0)

    def _ok(self, longest_hit: bool, overlap_hit: bool) -> bool:
        n = self.n + 1
        return ((self.longest_hits + longest_hit) / n <= HEURISTIC_TARGET or not longest_hit) and (
            (self.overlap_hits + overlap_hit) / n <= HEURISTIC_TARGET or not overlap_hit
        )

    def place(self, cand: McCandidate) -> tuple[dict[str, str], str] | None:
        """Options and correct letter for ``cand``, or ``None`` when it must be dropped."""
        pool = list(dict.fromkeys(cand.distractors))
        if len(pool) < 3:
            return None
        letters = sorted(LETTERS, key=lambda k: (self.letter_counts[k], k))
        for _ in range(self.tries):
            # Sample first, then check: normalising a whole pool (ICD categories hold
            # hundreds of long descriptions) would dominate the build time.
            chosen = self.rng.sample(pool, 3)
            for correct_letter in letters:
                others = [x for x in LETTERS if x != correct_letter]
                options = {correct_letter: cand.correct, **dict(zip(others, chosen, strict=True))}
                options = {k: options[k] for k in LETTERS}
                if len({normalize_answer(v) for v in options.values()}) < 4:
                    break
                lh = longest_option_letter(options) == correct_letter
                oh = overlap_option_letter(cand.stem, options) == correct_letter
                if self._ok(lh, oh):
                    self.n += 1
                    self.longest_hits += lh
                    self.overlap_hits += oh
                    self.letter_counts[correct_letter] += 1
                    return options, correct_letter
        return None


def mc_record(cand: McCandidate, options: dict[str, str], letter: str) -> Record:
    """The Search-R1 record for a placed MC item (options as lines "A. ..." in the question)."""
    question = cand.stem + "\n" + "\n".join(f"{k}. {options[k]}" for k in LETTERS)
    return make_record(
        "medical_mc",
        cand.qtype,
        cand.key,
        question,
        [letter],
        cand.entity,
        [cand.search_query],
        cand.answer_passage_id,
        options=options,
        answer_letter=letter,
        answer_text=options[letter],
    )


def _vignettes(src: Sources, rng: random.Random) -> list[McCandidate]:
    names = {t.id: t.name for t in src.hpo_terms}
    freq = Counter(p for d in src.diseases for p in d.phenotypes)
    by_pheno: dict[str, list[S.Disease]] = defaultdict(list)
    pheno_sets = {d.id: frozenset(d.phenotypes) for d in src.diseases}
    for d in src.diseases:
        for p in d.phenotypes:
            by_pheno[p].append(d)
    out = []
    for d in src.diseases:
        specific = [p for p in d.phenotypes if 2 <= freq[p] <= 300 and p in names]
        if len(specific) < 6:
            continue
        chosen = sorted(rng.sample(specific, 4))
        pool = {
            o.name
            for p in chosen
            for o in by_pheno[p]
            if o.id != d.id
            and not set(chosen) <= pheno_sets[o.id]
            and o.name.split()[0].lower() != d.name.split()[0].lower()
        }
        if len(pool) < 3:
            continue
        feats = [names[p].lower() for p in chosen]
        stem = (
            f"A patient presents with {', '.join(feats[:-1])} and {feats[-1]}. "
            "Which diagnosis is most likely?"
        )
        out.append(
            McCandidate(
                "vignette",
                d.id,
                stem,
                d.name,
                tuple(sorted(pool)),
                d.id,
                " ".join(feats),
                f"disease:{d.id}:0",
            )
        )
    return out


def _disease_gene(src: Sources) -> list[McCandidate]:
    all_genes = sorted({g for d in src.diseases for g in d.genes})
    out = []
    for i, d in enumerate(src.diseases):
        if len(d.genes) != 1 or _contains(d.name, d.genes[0]):
            continue
        # A deterministic window of other disease genes as the distractor pool.
        start = (i * 7919) % max(1, len(all_genes) - 20)
        pool = tuple(g for g in all_genes[start : start + 20] if g != d.genes[0])
        stem = f"Which gene is associated with {d.name}?"
        out.append(
            McCandidate(
                "disease_gene",
                d.id,
                stem,
                d.genes[0],
                pool,
                d.id,
                f"{d.name} gene",
                f"disease:{d.id}:0",
            )
        )
    return out


INHERITANCE_CLASSES = (
    "Autosomal dominant inheritance",
    "Autosomal recessive inheritance",
    "X-linked recessive inheritance",
    "X-linked dominant inheritance",
    "Mitochondrial inheritance",
)


def _inheritance(src: Sources) -> list[McCandidate]:
    """One inheritance mode per disease, class-balanced (equal items per class)."""
    per_class: dict[str, list[McCandidate]] = defaultdict(list)
    for d in src.diseases:
        modes = [m for m in d.inheritance if m in INHERITANCE_CLASSES]
        if len(modes) != 1 or len(d.inheritance) != 1:
            continue
        stem = f"What is the mode of inheritance of {d.name}?"
        pool = tuple(m for m in INHERITANCE_CLASSES if m != modes[0])
        per_class[modes[0]].append(
            McCandidate(
                "inheritance",
                d.id,
                stem,
                modes[0],
                pool,
                d.id,
                f"{d.name} inheritance",
                f"disease:{d.id}:0",
            )
        )
    usable = [c for c in per_class.values() if len(c) >= 50]
    n = min(len(c) for c in usable) if usable else 0
    return [x for c in usable for x in c[:n]]


def _definitions(src: Sources) -> list[McCandidate]:
    children: dict[str, list[S.HpoTerm]] = defaultdict(list)
    for t in src.hpo_terms:
        for p in t.parents:
            children[p].append(t)
    out = []
    for t in src.hpo_terms:
        if not t.definition or len(t.definition.split()) < 6 or _contains(t.definition, t.name):
            continue
        pool = {s.name for p in t.parents for s in children[p] if s.id != t.id}
        if len(pool) < 3:
            continue
        stem = f'Which HPO phenotype term is defined as: "{t.definition}"'
        out.append(
            McCandidate(
                "definition",
                t.id,
                stem,
                t.name,
                tuple(sorted(pool)),
                t.id,
                t.definition[:200],
                f"hpo:{t.id}:0",
            )
        )
    return out


def _icd10(src: Sources) -> list[McCandidate]:
    by_cat: dict[str, list[S.IcdCode]] = defaultdict(list)
    for c in src.icd10:
        if c.billable:
            by_cat[c.code[:3]].append(c)
    out = []
    for cat in sorted(by_cat):
        codes = by_cat[cat]
        if len(codes) < 4:
            continue
        for c in codes:
            pool = tuple(o.description for o in codes if o.code != c.code)
            stem = f"What condition does ICD-10-CM code {c.dotted} denote?"
            out.append(
                McCandidate(
                    "icd10",
                    c.code,
                    stem,
                    c.description,
                    pool,
                    f"icd10:{cat}",
                    f"ICD-10-CM {c.dotted}",
                    f"icd10cm:{c.code}:0",
                )
            )
    return out


MEDICINE_NON_CLASSES = frozenset(
    {
        "complementary",
        "specific",
        "non-specific",
        "for curative treatment",
        "for prophylaxis",
        "parenteral",
        "oral",
        "other",
    }
)
"""WHO list sub-headings that say which list or route, not which therapeutic class."""


def medicine_class(medicine: S.Medicine) -> str | None:
    """Most specific therapeutic class of a medicine, skipping list/route sub-headings
    (:data:`MEDICINE_NON_CLASSES`); ALL-CAPS section names in sentence case so letter case
    gives nothing away. ``None`` if there is none."""
    for c in medicine.classes:
        if c.lower() not in MEDICINE_NON_CLASSES:
            return c.capitalize() if c.isupper() else c
    return None


def _medicines(src: Sources) -> list[McCandidate]:
    classes = sorted({c for m in src.medicines if (c := medicine_class(m))})
    out = []
    for m in src.medicines:
        correct = medicine_class(m)
        if correct is None:
            continue
        pool = tuple(c for c in classes if c != correct)
        stem = (
            f"To which therapeutic class on the WHO list of essential medicines does "
            f"{m.name} belong?"
        )
        out.append(
            McCandidate(
                "medicine",
                m.name,
                stem,
                correct,
                pool,
                f"drug:{m.name}",
                f"{m.name} essential medicine class",
                f"medicines:{slug(m.name)}:0",
            )
        )
    return out


def medical_mc_records(src: Sources, seed: int = SEED) -> list[Record]:
    """MedQA-like A-D items from HPO, ICD-10-CM and essential medicines, admitted through
    one :class:`HeuristicBalancer` (per-type caps in :data:`CAP_MC`)."""
    rng = random.Random(seed)
    builders = {
        "vignette": lambda: _vignettes(src, rng),
        "disease_gene": lambda: _disease_gene(src),
        "inheritance": lambda: _inheritance(src),
        "definition": lambda: _definitions(src),
        "icd10": lambda: _icd10(src),
        "medicine": lambda: _medicines(src),
    }
    candidates: list[McCandidate] = []
    for qtype, build in builders.items():
        cands = build()
        rng.shuffle(cands)
        candidates += cands[: CAP_MC[qtype] * 2]  # spare items: the balancer drops some
    rng.shuffle(candidates)  # interleave types so the running rates mix them
    balancer = HeuristicBalancer(rng)
    taken: Counter = Counter()
    out = []
    for cand in candidates:
        if taken[cand.qtype] >= CAP_MC[cand.qtype]:
            continue
        placed = balancer.place(cand)
        if placed is None:
            continue
        taken[cand.qtype] += 1
        out.append(mc_record(cand, *placed))
    return out


# ---------------------------------------------------------------- splits and writing


def split_records(records: Iterable[Record]) -> dict[str, list[Record]]:
    """Records by split (by ``metadata.entity``), each sorted by id; ids must be unique.

    Raises:
        QABuildError: a duplicate id (names it).
    """
    out: dict[str, list[Record]] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    for r in records:
        if r["id"] in seen:
            raise QABuildError(f"duplicate QA record id {r['id']!r}")
        seen.add(r["id"])
        out[split_of(r["metadata"]["entity"])].append(r)
    return {s: sorted(v, key=lambda r: r["id"]) for s, v in out.items()}


def mc_heuristic_accuracy(records: Iterable[Record]) -> dict[str, float]:
    """Accuracy of "longest option" and "most word overlap" on MC records.

    Returns:
        ``{"longest_option": acc, "most_overlap": acc, "num_items": n}`` (acc in [0, 1]).
    """
    n = longest = overlap = 0
    for r in records:
        options = r["metadata"]["options"]
        stem = r["question"].split("\nA. ")[0]
        gold = r["golden_answers"][0]
        n += 1
        longest += longest_option_letter(options) == gold
        overlap += overlap_option_letter(stem, options) == gold
    return {
        "longest_option": longest / max(n, 1),
        "most_overlap": overlap / max(n, 1),
        "num_items": n,
    }


def write_split_files(qa_dir: Path, name: str, splits: dict[str, list[Record]]) -> None:
    """Write ``qa_dir/name/{split}.jsonl``."""
    folder = qa_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    for split, recs in splits.items():
        with (folder / f"{split}.jsonl").open("w", encoding="utf-8") as fh:
            for r in recs:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- retrieval measurement


def bm25_recall_at_k(
    passages: dict[str, str], queries: list[str], targets: list[str], k: int = 5
) -> float:
    """Fraction of queries whose target passage id is in the BM25 top-``k``.

    The retrieval server's own BM25 (:class:`retrieval_server.retrievers.BM25Retriever`: bm25s
    defaults, Lucene, k1=1.5, b=0.75, English stop words, Snowball English stemmer, ties
    broken by the smaller passage index) over all passages.
    """
    return _recall_with(_bm25_retriever(passages), queries, targets, k)


def _bm25_retriever(passages: dict[str, str]) -> BM25Retriever:
    """The retrieval server's BM25 over ``passages`` (id -> text, in this order)."""
    from retrieval_server.passages import Passages
    from retrieval_server.retrievers import BM25Retriever

    return BM25Retriever.build(Passages(ids=list(passages), contents=list(passages.values())))


def _recall_with(retriever: BM25Retriever, queries: list[str], targets: list[str], k: int) -> float:
    """Recall@``k`` of ``targets[i]`` (a passage id) for ``queries[i]``; 0.0 for no queries.

    The server's search scores only passages that share a term with the query; bm25s's own
    ``retrieve`` ranks every passage with ``np.argpartition``, which on scores that are
    almost all 0 took ~50 ms per query here (15 min of ``stppo prepare``).
    """
    if not queries:
        return 0.0
    ids = retriever.passages.ids
    hits = retriever.search(queries, topk=k)
    found = sum(
        t in {ids[j] for j in h.passage_indices} for t, h in zip(targets, hits, strict=True)
    )
    return found / len(queries)


def retrieval_report(
    passages: dict[str, str], sets: dict[str, list[Record]], k: int = 5, sample: int = 3000
) -> dict:
    """BM25 recall@k of the answer passage: raw question (one hop) for every set, and for
    multi-hop also the demonstrator's second query (bridge hop). At most ``sample`` items
    per measurement (deterministic sample)."""
    retriever = _bm25_retriever(passages)
    rng = random.Random(SEED)
    report: dict = {"k": k}
    for name, recs in sets.items():
        picked = recs if len(recs) <= sample else rng.sample(recs, sample)
        stems = [r["question"].split("\nA. ")[0] for r in picked]
        targets = [r["metadata"]["answer_passage_id"] for r in picked]
        entry = {
            "num_measured": len(picked),
            "recall_raw_question": _recall_with(retriever, stems, targets, k),
        }
        if name == "multi_hop":
            entry["recall_first_query_finds_bridge_passage"] = _recall_with(
                retriever,
                [r["metadata"]["search_queries"][0] for r in picked],
                [r["metadata"]["first_passage_id"] for r in picked],
                k,
            )
            entry["recall_second_query"] = _recall_with(
                retriever,
                [r["metadata"]["search_queries"][1] for r in picked],
                targets,
                k,
            )
            by_type: dict[str, list[Record]] = defaultdict(list)
            for r in picked:
                by_type[r["metadata"]["type"].split("_country_")[0]].append(r)
            entry["recall_raw_question_by_first_entity"] = {
                t: _recall_with(
                    retriever,
                    [r["question"] for r in rs],
                    [r["metadata"]["answer_passage_id"] for r in rs],
                    k,
                )
                for t, rs in sorted(by_type.items())
            }
        report[name] = entry
    return report


# ---------------------------------------------------------------- build


MIN_COUNTS = {"single_hop": 10_000, "multi_hop": 5_000, "medical_mc": 10_000}
MAX_ONE_HOP_RECALL_MULTI = 0.15
MAX_HEURISTIC_GAP = 0.05


@dataclass(frozen=True)
class QAReport:
    """Outcome of :func:`build_qa`: ``report`` is the content of ``data/qa/report.json``."""

    qa_dir: Path
    built: bool
    report: dict
    size_mib: float
    elapsed_s: float


def read_passages(path: Path) -> dict[str, str]:
    """``passages.jsonl`` -> ``{id: contents}`` (file order).

    Raises:
        QABuildError: the corpus file is missing (the QA step needs the corpus step first).
    """
    if not path.is_file():
        raise QABuildError(
            f"{path} is missing: build the corpus first (stppo prepare --only corpus)"
        )
    out = {}
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            out[rec["id"]] = rec["contents"]
    return out


def _check_contract(report: dict) -> None:
    for name, minimum in MIN_COUNTS.items():
        if report["counts"][name]["total"] < minimum:
            raise QABuildError(f"{name}: {report['counts'][name]['total']} items < {minimum}")
    recall = report["retrieval"]["multi_hop"]["recall_raw_question"]
    if recall >= MAX_ONE_HOP_RECALL_MULTI:
        raise QABuildError(
            f"multi_hop one-hop BM25 recall@5 {recall:.3f} >= {MAX_ONE_HOP_RECALL_MULTI}"
        )
    for h, acc in report["medical_mc_heuristics"]["all"].items():
        if h != "num_items" and abs(acc - CHANCE) > MAX_HEURISTIC_GAP:
            raise QABuildError(
                f"medical_mc heuristic {h} accuracy {acc:.3f} is not within "
                f"{MAX_HEURISTIC_GAP} of chance {CHANCE}"
            )


def _folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def build_qa(data_dir: Path, force: bool = False) -> QAReport:
    """Build (or verify) ``data_dir/qa``: three sets x three splits + ``report.json``.

    Needs ``data_dir/corpus/passages.jsonl`` (answer passage ids are checked against it).
    Written to ``qa.tmp`` and renamed when complete and within contract (counts, multi-hop
    one-hop recall < 0.15, MC heuristics within 5 points of chance).

    Raises:
        QABuildError: corpus missing, or a set misses its contract (message says which).
        PackageError / SourceError: bad source package or file (names it).
    """
    start = time.perf_counter()
    qa_dir = data_dir / "qa"
    corpus_sha256 = _corpus_sha256(data_dir)
    if qa_dir.is_dir() and not force and _is_current(qa_dir, corpus_sha256):
        return _verify_qa(qa_dir, start)
    passages = read_passages(data_dir / "corpus" / "passages.jsonl")
    src = load_sources(data_dir)
    facts = country_facts(src.factbook, passages)
    sets = {
        "single_hop": single_hop_records(src, passages, facts),
        "multi_hop": multi_hop_records(src, facts, passages),
        "medical_mc": medical_mc_records(src),
    }
    for name, recs in sets.items():
        missing = [r["id"] for r in recs if r["metadata"]["answer_passage_id"] not in passages]
        if missing:
            raise QABuildError(
                f"{name}: {len(missing)} records point at passages not in the "
                f"corpus, e.g. {missing[:3]}"
            )
    tmp = qa_dir.with_name("qa.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts, heuristics = {}, {}
    for name, recs in sets.items():
        splits = split_records(recs)
        write_split_files(tmp, name, splits)
        counts[name] = {s: len(v) for s, v in splits.items()} | {
            "total": len(recs),
            "by_type": dict(sorted(Counter(r["metadata"]["type"] for r in recs).items())),
            "num_entities": len({r["metadata"]["entity"] for r in recs}),
        }
        if name == "medical_mc":
            heuristics = {"all": mc_heuristic_accuracy(recs)} | {
                s: mc_heuristic_accuracy(v) for s, v in splits.items()
            }
            heuristics["answer_letter_counts"] = dict(
                sorted(Counter(r["golden_answers"][0] for r in recs).items())
            )
    report = {
        "counts": counts,
        "medical_mc_heuristics": heuristics,
        "chance": CHANCE,
        "retrieval": retrieval_report(passages, sets),
        "split_rule": "sha256('stppo-split:'+metadata.entity) % 100: <80 train, <90 validation, "
        "else test",
        "seed": SEED,
        "build_version": BUILD_VERSION,
        "corpus_sha256": corpus_sha256,
    }
    _check_contract(report)
    (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if qa_dir.exists():
        shutil.rmtree(qa_dir)
    tmp.rename(qa_dir)
    return QAReport(qa_dir, True, report, _folder_mib(qa_dir), time.perf_counter() - start)


def _corpus_sha256(data_dir: Path) -> str:
    manifest = data_dir / "corpus" / "manifest.json"
    if not manifest.is_file():
        raise QABuildError(
            f"{manifest} is missing: build the corpus first (stppo prepare --only corpus)"
        )
    return read_manifest(
        manifest, ("passages_sha256",), "rebuild it: stppo prepare --only corpus --force"
    )["passages_sha256"]


def _is_current(qa_dir: Path, corpus_sha256: str) -> bool:
    """True when ``qa_dir`` was built by this :data:`BUILD_VERSION` from this corpus (a
    missing report counts as current, so :func:`_verify_qa` reports it)."""
    path = qa_dir / "report.json"
    if not path.is_file():
        return True
    report = json.loads(path.read_text())
    return (
        report.get("build_version") == BUILD_VERSION
        and report.get("corpus_sha256") == corpus_sha256
    )


def _verify_qa(qa_dir: Path, start: float) -> QAReport:
    report_path = qa_dir / "report.json"
    if not report_path.is_file():
        raise QABuildError(f"{report_path} is missing (delete {qa_dir} or use force)")
    report = read_manifest(
        report_path,
        ("counts", "retrieval", "medical_mc_heuristics"),
        f"delete {qa_dir} or use force",
    )
    for name in SETS:
        for split in SPLITS:
            path = qa_dir / name / f"{split}.jsonl"
            if not path.is_file():
                raise QABuildError(f"QA file {path} is missing (delete {qa_dir} or use force)")
            with path.open("rb") as fh:
                n = sum(1 for _ in fh)
            if n != report["counts"][name][split]:
                raise QABuildError(
                    f"{path} has {n} records, report.json says "
                    f"{report['counts'][name][split]} (use force)"
                )
    return QAReport(qa_dir, False, report, _folder_mib(qa_dir), time.perf_counter() - start)
