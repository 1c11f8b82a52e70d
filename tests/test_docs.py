"""The documentation builds (issue 29): ``mkdocs build --strict`` over docs/ and the API reference from the docstrings,
so a broken reference or a dead link fails CI; the README stays a front door whose links resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
"""A Markdown link's target, without its anchor."""


def dead_links(page: Path) -> list[str]:
    """The relative link targets of a Markdown page that name no file."""
    return [
        target for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]  # fmt: skip


@pytest.mark.slow
def test_the_site_and_the_api_reference_build_strictly(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    engine = (tmp_path / "site" / "api" / "engine" / "index.html").read_text()
    assert "build_layout" in engine, "the API reference renders the subpackages' members"


def test_the_readme_is_a_front_door_whose_links_resolve() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 200, "the README is a front door: the rest belongs in docs/"
    assert dead_links(readme) == []
    assert "make train" in readme.read_text() and "make test" in readme.read_text()


def test_the_make_targets_the_docs_name_exist() -> None:
    """``make train``, ``make test`` and the others the README and docs/ tell a reader to run are Makefile targets."""
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {target for page in pages for target in re.findall(r"`make ([a-z][a-z-]*)\b", page.read_text())}
    named |= set(re.findall(r"make ([a-z][a-z-]*) &&", (ROOT / "README.md").read_text()))
    assert {"train", "test"} <= named
    assert named - targets == set(), "the docs name make targets the Makefile lacks"


def test_every_relative_link_in_docs_resolves() -> None:
    """mkdocs checks the links between its pages; this also covers a page's links outside docs/."""
    pages = sorted((ROOT / "docs").rglob("*.md"))
    assert pages, "docs/ holds the documentation"
    assert {str(page.relative_to(ROOT)): dead_links(page) for page in pages if dead_links(page)} == {}


def test_a_dead_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [anchor](there.md#a) [web](https://example.org) [dead](gone.md)")
    assert dead_links(page) == ["gone.md"]


CONFLICT_MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.MULTILINE)


def test_no_tracked_text_file_holds_a_merge_conflict_marker() -> None:
    """A merge once committed ``<<<<<<< HEAD`` into docs/performance.md and the strict site build passed: Markdown
    renders the markers as text. Every tracked text file is read for them."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    suffixes = {".md", ".py", ".yaml", ".toml", ".txt", ".cfg", ".ipynb", ".sh"}
    marked = [
        name
        for name in tracked
        if Path(name).suffix in suffixes
        and (ROOT / name).is_file()
        and CONFLICT_MARKER.search((ROOT / name).read_text(errors="replace"))
    ]
    assert not marked, f"merge conflict markers in: {', '.join(marked)}"
