"""The KubeRay operator the docs install is the release whose CRDs the manifests are
validated against (``deploy/schemas/kuberay/``): every ``helm install`` of the operator
pins ``--version`` to ``SOURCE_VERSION``."""

from __future__ import annotations

import re

from services.env import PROJECT_ROOT

SCHEMAS = PROJECT_ROOT / "deploy" / "schemas" / "kuberay"
HELM_INSTALL = re.compile(r"helm (?:install|upgrade)\b[^\n`]*kuberay/kuberay-operator[^\n`]*")


def test_every_helm_install_of_the_operator_pins_the_schemas_version():
    version = (SCHEMAS / "SOURCE_VERSION").read_text().strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    pages = [PROJECT_ROOT / "README.md", PROJECT_ROOT / "deploy" / "README.md"]
    pages += sorted((PROJECT_ROOT / "docs").rglob("*.md"))
    installs = [
        (page.relative_to(PROJECT_ROOT), match.group(0))
        for page in pages
        for match in HELM_INSTALL.finditer(page.read_text())
    ]
    assert len(installs) >= 2  # deploy/README.md and the KubeRay task page
    unpinned = [f"{page}: {line}" for page, line in installs if f"--version {version}" not in line]
    assert unpinned == [], "\n".join(unpinned)
    assert f"v{version}" in (SCHEMAS / "README.md").read_text()
