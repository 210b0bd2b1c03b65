"""Every reference in the docs resolves: markdown links to files of the repository, and the
repository paths the README's layout table names."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_markdown_links_resolve():
    missing = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def test_doc_mentions_of_repository_files_resolve():
    """Mentions like `docs/verl.md` in code and docs (not only links) name files that exist."""
    missing = []
    files = [p for p in ROOT.rglob("*") if p.suffix in {".py", ".md", ".sh"} and not any(part.startswith(".venv") for part in p.parts) and ".git" not in p.parts]
    for path in files:
        for target in re.findall(r"(?<![\w./-])((?:docs|tools|configs)/[\w./-]+\.(?:md|py|sh|png|yaml|json|txt|log))", path.read_text(errors="ignore")):
            if not (ROOT / target).exists():
                missing.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def test_layout_table_matches_the_tree():
    table = README_LAYOUT_ROWS()
    assert table, "README has no layout table"
    for path in table:
        assert (ROOT / path.rstrip("/")).exists(), f"README layout table names {path}, which does not exist"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    top_level = {f.split("/")[0] for f in tracked if "/" in f and not f.startswith(".")}
    if not tracked:
        pytest.skip("not a git checkout")
    named = {p.rstrip("/").split("/")[0] for p in table}
    assert top_level <= named, f"folders missing from README's layout table: {sorted(top_level - named)}"


def README_LAYOUT_ROWS():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout of the repository", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)


README_MAX_LINES = 150


def test_readme_reads_in_five_minutes():
    """The README stays a newcomer's page: at most 150 lines; details go to docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move details to docs/"


def test_support_page_names_tests_that_exist():
    """docs/support.md backs each support-matrix cell with tests: every test function and test file it
    names (and every `tests/<file>.py::<name>` in any doc) exists, so a renamed test cannot leave a
    cell pointing at nothing."""
    sources = {p.name: p.read_text() for p in (ROOT / "tests").glob("*.py")}
    defined = {name for text in sources.values() for name in re.findall(r"^\s*def (test_\w+)", text, flags=re.M)}
    missing = []
    for name, py in re.findall(r"\b(test_\w+)(\.py)?", (ROOT / "docs" / "support.md").read_text()):
        if (py and f"{name}.py" not in sources) or (not py and name not in defined):
            missing.append(f"docs/support.md -> {name}{py}")
    for doc in DOCS:
        for file, name in re.findall(r"tests/(test_\w+\.py)::(test_\w+)", doc.read_text()):
            if not re.search(rf"^\s*def {name}\b", sources.get(file, ""), flags=re.M):
                missing.append(f"{doc.relative_to(ROOT)} -> tests/{file}::{name}")
    assert not missing, missing


DOC_PAGES_MAX = 7
BENCHMARKS_MAX_LINES = 250


def test_docs_is_a_manual_of_a_few_pages():
    """docs/ is a user's manual of at most 7 pages, one subject each; BENCHMARKS.md holds today's figures
    only, in at most 250 lines."""
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) <= DOC_PAGES_MAX, f"docs/ has {len(pages)} pages, at most {DOC_PAGES_MAX}: {pages}"
    lines = len((ROOT / "BENCHMARKS.md").read_text().splitlines())
    assert lines <= BENCHMARKS_MAX_LINES, f"BENCHMARKS.md has {lines} lines, at most {BENCHMARKS_MAX_LINES}"


# Words about how the work was organised, which a reader who never saw the work cannot use.
WORK_WORDS = re.compile(r"ses(s)ion|device\stime|call [0-9]|(first|second|third|fourth) round|issue [0-9]", re.I)


def test_docs_and_tools_speak_of_the_project_not_of_its_work():
    """README, BENCHMARKS, docs/ (raw results included), tools/ and configs/ name no periods of work, no
    accelerator budget, no numbered calls, rounds or issue numbers: `WORK_WORDS`, the pattern CI greps for."""
    paths = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    for folder in ("docs", "tools", "configs"):
        paths += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and p.suffix != ".png"]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for p in paths
             for n, line in enumerate(p.read_text(errors="ignore").splitlines(), 1) if WORK_WORDS.search(line)]
    assert not found, found
