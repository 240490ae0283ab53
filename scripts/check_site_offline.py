#!/usr/bin/env python3
"""Fail when the built docs site would load something from outside itself.

Usage: ``python scripts/check_site_offline.py [SITE_DIR]`` (default ``site/``; `make docs`
runs it after the build). Exit 0 with a one-line summary, or 1 with one line per offence.

What it reads, in every ``*.html`` and ``*.css`` file under SITE_DIR:

- HTML elements that make the browser fetch something: ``<script src>``, ``<link href>``
  whose ``rel`` loads (stylesheet, preload, modulepreload, prefetch, preconnect,
  dns-prefetch, icon, apple-touch-icon, manifest), ``src`` / ``srcset`` / ``poster`` /
  ``data`` of img, source, iframe, embed, object, video, audio, track, input, and
  ``url(...)`` / ``@import`` inside ``<style>`` elements and ``style`` attributes;
- in stylesheets, ``@import`` and every ``url(...)`` (fonts, images).

A reference is external when it has a scheme other than ``data:`` / ``blob:`` (``https:``,
``http:``, ...) or starts with ``//``. A local reference must name a file of the site:
a vendored asset that is missing is reported too. Links (``<a href>``, ``rel=canonical``,
``prev``, ``next``, ``alternate``) are not loads and are not checked.

One load happens in script code rather than in markup: Material for MkDocs fetches Mermaid
from unpkg when a page has a diagram and no global ``mermaid``. So a page with a
``class="mermaid"`` block must also load a local ``mermaid.min.js`` (scripts/mkdocs_hooks.py
adds it).
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

LOADING_RELS = {
    "stylesheet",
    "preload",
    "modulepreload",
    "prefetch",
    "preconnect",
    "dns-prefetch",
    "icon",
    "shortcut",
    "apple-touch-icon",
    "manifest",
}
SRC_TAGS = {"img", "source", "iframe", "embed", "video", "audio", "track", "input", "script"}
SRC_ATTRS = {"src", "srcset", "poster", "data"}
CSS_URL = re.compile(r"""url\(\s*(['"]?)([^'")]*)\1\s*\)""", re.I)
CSS_IMPORT = re.compile(r"""@import\s+(['"])([^'"]+)\1""", re.I)
LOCAL_SCHEMES = {"data", "blob", "about"}


def is_external(ref: str) -> bool:
    ref = ref.strip()
    if ref.startswith("//"):
        return True
    scheme = urlsplit(ref).scheme.lower()
    return bool(scheme) and scheme not in LOCAL_SCHEMES


def css_refs(text: str) -> list[str]:
    return [m.group(2) for m in CSS_URL.finditer(text)] + [
        m.group(2) for m in CSS_IMPORT.finditer(text)
    ]


def srcset_urls(value: str) -> list[str]:
    return [part.strip().split()[0] for part in value.split(",") if part.strip()]


class _Loads(HTMLParser):
    """Collects (what, reference) for every fetch an HTML page makes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.loads: list[tuple[str, str]] = []
        self.has_mermaid = False
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        a = {k: (v or "") for k, v in attrs}
        classes = a.get("class", "").split()
        if "mermaid" in classes:
            self.has_mermaid = True
        if tag == "link" and a.get("href"):
            rels = set(a.get("rel", "").lower().split())
            if rels & LOADING_RELS:
                self.loads.append((f"<link rel={a.get('rel')}>", a["href"]))
        if tag in SRC_TAGS or tag == "object":
            for attr in SRC_ATTRS & a.keys():
                if not a[attr]:
                    continue
                refs = srcset_urls(a[attr]) if attr == "srcset" else [a[attr]]
                self.loads += [(f"<{tag} {attr}>", ref) for ref in refs]
        if a.get("style"):
            self.loads += [(f"<{tag} style>", ref) for ref in css_refs(a["style"])]
        if tag == "style":
            self._in_style = True

    def handle_endtag(self, tag):
        if tag == "style":
            self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.loads += [("<style>", ref) for ref in css_refs(data)]


def _local_target(site: Path, file: Path, ref: str, base: str) -> Path | None:
    """The site file a local reference names, or None when it names none (a bare '#x').

    A path from the root (404.html uses them) starts with ``base``, the path of site_url.
    """
    path = unquote(urlsplit(ref).path)
    if not path:
        return None
    if not path.startswith("/"):
        return (file.parent / path).resolve()
    if path.startswith(base):
        path = path[len(base) :]
    return (site / path.lstrip("/")).resolve()


def site_base(config: Path) -> str:
    """The path part of ``site_url`` in mkdocs.yml (``/`` without one)."""
    text = config.read_text(encoding="utf-8") if config.is_file() else ""
    m = re.search(r"^site_url:\s*(\S+)", text, re.M)
    path = urlsplit(m.group(1)).path if m else "/"
    return path if path.endswith("/") else path + "/"


def check_site(site: Path, base: str = "/") -> tuple[list[str], int]:
    """(offences, number of loads checked) of the built site at ``site``, served at the
    path ``base``."""
    site = site.resolve()
    problems: list[str] = []
    checked = 0
    files = sorted(site.rglob("*.html")) + sorted(site.rglob("*.css"))
    for file in files:
        rel = file.relative_to(site)
        text = file.read_text(encoding="utf-8", errors="replace")
        if file.suffix == ".css":
            loads = [("url()/@import", ref) for ref in css_refs(text)]
            mermaid_needed = False
        else:
            parser = _Loads()
            parser.feed(text)
            parser.close()
            loads = parser.loads
            mermaid_needed = parser.has_mermaid
        for what, ref in loads:
            checked += 1
            if is_external(ref):
                problems.append(f"{rel}: {what} loads {ref} from outside the site")
                continue
            if urlsplit(ref).scheme.lower() in LOCAL_SCHEMES:
                continue
            target = _local_target(site, file, ref, base)
            if target is not None and not target.is_file():
                problems.append(f"{rel}: {what} names {ref}, which is not in the site")
        if mermaid_needed and not any(
            what == "<script src>" and ref.endswith("mermaid.min.js") and not is_external(ref)
            for what, ref in loads
        ):
            problems.append(
                f"{rel}: a Mermaid diagram without a local mermaid.min.js: Material would "
                "fetch Mermaid from unpkg (scripts/mkdocs_hooks.py adds the script)"
            )
    if not any(f.suffix == ".html" for f in files):
        problems.append(f"{site}: no HTML page (build the site first: make docs)")
    return problems, checked


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    site = Path(argv[1]) if len(argv) > 1 else root / "site"
    problems, checked = check_site(site, site_base(root / "mkdocs.yml"))
    if problems:
        print("\n".join(problems), file=sys.stderr)
        print(
            f"[check_site_offline] {len(problems)} problem(s): the site must load only its "
            "own files (vendor assets with scripts/vendor_docs_assets.sh)",
            file=sys.stderr,
        )
        return 1
    print(f"[check_site_offline] {checked} loads checked in {site}: none from outside")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
