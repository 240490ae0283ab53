"""The built docs site loads nothing from outside itself (scripts/check_site_offline.py,
run by `make docs`): the real site, built here, passes; a page or stylesheet that names a
CDN script, style or font, or a diagram without the local Mermaid, fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from script_modules import load_script

from services.env import PROJECT_ROOT

check = load_script(PROJECT_ROOT / "scripts" / "check_site_offline.py", "check_site_offline")


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The docs site built from the working tree (strict, as `make docs` builds it)."""
    site = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=PROJECT_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def test_the_built_site_loads_nothing_from_outside(built_site):
    problems, checked = check.check_site(built_site, check.site_base(PROJECT_ROOT / "mkdocs.yml"))
    assert problems == []
    assert checked > 100  # every page's scripts and styles were read


def test_the_built_site_renders_formulas_and_diagrams_with_its_own_copies(built_site):
    algorithms = (built_site / "algorithms" / "index.html").read_text()
    assert 'class="arithmatex"' in algorithms  # LaTeX, typeset by KaTeX in the browser
    assert '<script src="../assets/katex/katex.min.js">' in algorithms
    assert '<link rel="stylesheet" href="../assets/katex/katex.min.css">' in algorithms
    architecture = (built_site / "architecture" / "index.html").read_text()
    assert 'class="mermaid"' in architecture
    assert '<script src="../assets/mermaid/mermaid.min.js">' in architecture
    fonts = sorted(p.name for p in (built_site / "assets" / "katex" / "fonts").iterdir())
    assert fonts and all(name.endswith(".woff2") for name in fonts)


def test_the_result_dumps_are_out_of_the_search_index(built_site):
    import json

    index = json.loads((built_site / "search" / "search_index.json").read_text())
    locations = {doc["location"].split("#")[0] for doc in index["docs"]}
    assert "reference/config/" in locations
    assert "results/" in locations  # the results page itself is indexed
    assert not [loc for loc in locations if loc.startswith("results/") and loc != "results/"]


def test_the_config_asks_for_nothing_from_outside():
    config = (PROJECT_ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^  font: false\b", config, re.M), "Material would load Google Fonts"
    assert not re.search(r"^\s*-\s*(https?:)?//", config, re.M)  # extra_javascript / extra_css


def write_site(root, html: str, css: str = "") -> None:
    (root / "assets").mkdir(parents=True)
    (root / "assets" / "app.js").write_text("")
    (root / "assets" / "font.woff2").write_bytes(b"")
    (root / "index.html").write_text(html)
    (root / "assets" / "style.css").write_text(css)


CLEAN = (
    '<html><head><link rel="stylesheet" href="assets/style.css">'
    '<link rel="canonical" href="https://example.org/">'
    '<script src="assets/app.js"></script></head>'
    '<body><a href="https://github.com/">a link is not a load</a>'
    '<img src="data:image/png;base64,AAAA"></body></html>'
)


def test_a_clean_tiny_site_passes(tmp_path):
    write_site(tmp_path, CLEAN, "@font-face{src:url(font.woff2) format('woff2')}")
    assert check.check_site(tmp_path) == ([], 4)
    assert check.main(["check", str(tmp_path)]) == 0


@pytest.mark.parametrize(
    ("html", "css", "expected"),
    [
        (
            CLEAN.replace(
                "</head>", '<script src="https://cdn.jsdelivr.net/npm/katex"></script></head>'
            ),
            "",
            "<script src> loads https://cdn.jsdelivr.net/npm/katex",
        ),
        (  # what Material writes when theme.font is not false
            CLEAN.replace(
                "</head>",
                '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">'
                "</head>",
            ),
            "",
            "<link rel=stylesheet> loads https://fonts.googleapis.com",
        ),
        (CLEAN, "@font-face{src:url(//fonts.gstatic.com/x.woff2)}", "loads //fonts.gstatic.com"),
        (CLEAN, '@import "https://unpkg.com/a.css";', "loads https://unpkg.com/a.css"),
        (
            CLEAN.replace("<body>", '<body style="background:url(http://x.org/a.png)">'),
            "",
            "http://x.org",
        ),
        (
            CLEAN.replace("assets/app.js", "assets/missing.js"),
            "",
            "assets/missing.js, which is not",
        ),
        (CLEAN.replace("<body>", '<body><pre class="mermaid">flowchart LR</pre>'), "", "unpkg"),
    ],
    ids=[
        "cdn-script",
        "google-fonts",
        "css-font",
        "css-import",
        "style-attr",
        "missing",
        "mermaid",
    ],
)
def test_an_outside_load_fails(tmp_path, html, css, expected):
    write_site(tmp_path, html, css)
    problems, _ = check.check_site(tmp_path)
    assert len(problems) == 1 and expected in problems[0], problems
    assert check.main(["check", str(tmp_path)]) == 1


def test_an_empty_site_fails(tmp_path):
    problems, _ = check.check_site(tmp_path)
    assert problems and "no HTML page" in problems[0]
