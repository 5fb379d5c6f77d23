"""The documentation a user reads: the README a map of at most 1,800 words, and every link in it and in docs/ leading
somewhere (a file of the repository, and a heading of it where the link names one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> list[str]:
    """The lines of running text: not code blocks, tables or headings."""
    lines, code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            code = not code
        elif not code and line and not line.startswith(("|", "#", "![")):
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchor of each heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_a_map():
    text = (REPO / "README.md").read_text()
    words = len(re.sub(r"```.*?```", "", text, flags=re.S).split())  # its prose and tables, not the output it shows
    assert words <= 1800, words
    assert not [line for line in prose(text) if len(line) > 200]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_leads_somewhere(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(target)
    assert not broken, broken


def test_every_module_of_infra_is_on_the_architecture_map():
    """docs/architecture.md names each file of infra/ (a package's folder, infra/replicas/ say, names its files)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    missing = []
    for path in sorted((REPO / "infra").rglob("*.py")):
        name = path.relative_to(REPO).as_posix()
        folder = path.parent.relative_to(REPO).as_posix() + "/"
        if path.name not in ("__init__.py", "__main__.py") and name not in text and f"`{folder}`" not in text:
            missing.append(name)
    assert not missing, f"not on the map of docs/architecture.md: {missing}"
