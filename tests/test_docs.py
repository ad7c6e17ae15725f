"""The documentation: the Sphinx site in docs/ builds with warnings as errors (a broken cross-reference, a missing page,
anchor or include, a docstring that does not render all fail), every relative link of README.md resolves (file and
heading), and the README stays a front door."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import README, REPO

DOCS = REPO / "docs"


def build(docs: Path, out: Path) -> subprocess.CompletedProcess:
    """verl's own toolchain, Sphinx + MyST, as a user would build the site; -W: any warning fails the build."""
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(docs), str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    result = build(DOCS, tmp_path / "html")
    assert result.returncode == 0, result.stderr[-5000:]
    pages = {p.stem for p in (tmp_path / "html").glob("*.html")}
    listed = set(re.findall(r"^(\w+)$", (DOCS / "index.md").read_text(), re.M))
    assert listed and listed <= pages
    assert {p.stem for p in DOCS.glob("*.md")} - {"index"} == listed, "a page in docs/ that the index does not list"
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("preference.mine_preference_pairs", "step_batch.preference_term_weight",
                 "lambda_control.LambdaController"):  # autodoc rendered them: each has its own entry
        assert f'id="amir_verl.{name}"' in api, name


@pytest.mark.parametrize("breakage", ["a link to a missing page", "a link to a missing heading"])
def test_a_broken_link_fails_the_build(tmp_path, breakage):
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs, ignore=shutil.ignore_patterns("_build"))
    target = "no_such_page.md" if breakage == "a link to a missing page" else "usage.md#no-such-heading"
    with (docs / "method.md").open("a") as page:
        page.write(f"\nSee [this]({target}).\n")
    result = build(docs, tmp_path / "html")
    assert result.returncode != 0 and "method.md" in result.stderr, result.stderr[-2000:]


def slug(heading: str) -> str:
    """MyST's anchor of a heading (myst_heading_anchors): lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' line in a code block is no heading
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def relative_links(markdown: str) -> list[str]:
    return [link for link in re.findall(r"\]\(([^)\s]+)\)", markdown) if not re.match(r"[a-z]+://|mailto:", link)]


def test_every_relative_link_of_the_readme_resolves():
    links = relative_links(README.read_text())
    assert len(links) > 10
    for link in links:
        path, _, anchor = link.partition("#")
        target = REPO / path if path else README
        assert target.exists(), f"README links {link}: no such file"
        if anchor:
            assert anchor in anchors(target), f"README links {link}: {path} has no heading with that anchor"


def test_the_link_check_catches_a_missing_heading():
    assert "amir-config-keys" in anchors(DOCS / "usage.md")
    assert "no-such-heading" not in anchors(DOCS / "usage.md")


def test_the_readme_is_a_front_door():
    """At most 200 lines, and no measurement history: per-commit figures and timings live in docs/results/."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert not re.search(r"\b\d[\d,]* s\b|\bCPU-s\b|\bmin \d+ s\b", text), "a timing in the README: docs/results/"
