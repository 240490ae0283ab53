"""MkDocs hooks of the docs site (mkdocs.yml, ``hooks:``).

- The result dumps under ``docs/results/`` (tables written by ``stppo experiment`` and the
  benchmarks, read by code and tests by path, so they carry no front matter) stay out of
  the search index: a search for a configuration field should find the reference, not a
  table row of an experiment. The results and benchmarks pages that link to them are
  indexed.
- A page with a Mermaid diagram loads the site's own copy of Mermaid
  (``docs/assets/mermaid/``, scripts/vendor_docs_assets.sh) before Material's bundle runs:
  Material renders with a global ``mermaid`` when there is one and otherwise fetches it
  from unpkg. Only those pages pay for the 3.5 MB script.
"""

from __future__ import annotations

import re

from mkdocs.utils import get_relative_url

RAW_DIR = "results/"
MERMAID_JS = "assets/mermaid/mermaid.min.js"
BUNDLE_SCRIPT = re.compile(r'<script src="[^"]*assets/javascripts/bundle\.[0-9a-f]+\.min\.js">')


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith(RAW_DIR):
        search = page.meta.get("search") or {}
        page.meta["search"] = {**search, "exclude": True}
    return markdown


def on_post_page(output, page, config):
    if 'class="mermaid"' not in output:
        return output
    src = get_relative_url(MERMAID_JS, page.url)
    match = BUNDLE_SCRIPT.search(output)
    if match is None:
        raise RuntimeError(f"{page.file.src_uri}: Material's bundle script not found")
    return output[: match.start()] + f'<script src="{src}"></script>\n' + output[match.start() :]
