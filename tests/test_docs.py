"""The product docs (README.md, docs/*.md) name only files that exist in the repository.

A plain scan, no markdown parser: relative markdown links must resolve to a file in the
repository, and every repository path written in backticks (one that starts with a
top-level folder such as `services/` or `docs/` and carries no placeholder like `<run_dir>`
or `{a,b}`) must exist. Paths that leave the repository (a parent-folder escape, or
the absolute checkout folder of a development machine) and the team-note files that once lived in docs/ must not come back.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Notes about how the code was written, not documentation: none of them may exist or be named.
TEAM_NOTES = ("HELPERS-brief.md", "CONTRACTS-internal.md", "DESIGN.md")

_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)[^)]*\)")
_CODE = re.compile(r"`([^`\n]+)`")
_SPLIT = re.compile(r"[\s=,;()\"']+")
_PLACEHOLDER = re.compile(r"[<>{}*$\[\]]")
# Absolute paths of the machine the code was written on, and escapes from the repository.
# Spelled in pieces so that this file itself holds no such path.
_UP = "." + "./"
_ABS = "/" + "work/"
_OUTSIDE = re.compile(r"(?<![\w.])(?:" + re.escape(_UP) + "|" + re.escape(_ABS) + ")")


# Top-level folders of the repository (run outputs such as runs/ are not part of it).
REPO_DIRS = frozenset(
    {
        ".ci",
        "benchmarks",
        "deploy",
        "docs",
        "examples",
        "flywheel_proto",
        "proto",
        "services",
        "tests",
        "tools",
    }
)


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def problems(path: Path, root: Path = ROOT) -> list[str]:
    """Every bad reference in one markdown file, as `file: what`."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(root).as_posix()
    out: list[str] = []
    for note in TEAM_NOTES:
        if note in text:
            out.append(f"{name}: names the team note {note}")
    for m in _OUTSIDE.finditer(text):
        line = text[: m.start()].count("\n") + 1
        out.append(f"{name}:{line}: a path outside the repository ({m.group(0)!r})")
    for m in _LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # anchor, http:, mailto:
            continue
        resolved = (path.parent / target).resolve()
        if not resolved.is_relative_to(root):
            out.append(f"{name}: link {target!r} leaves the repository")
        elif not resolved.exists():
            out.append(f"{name}: link {target!r} points to nothing")
    for m in _CODE.finditer(text):
        for token in _SPLIT.split(m.group(1)):
            token = token.removeprefix("./")
            if "/" not in token or _PLACEHOLDER.search(token):
                continue
            if token.split("/", 1)[0] not in REPO_DIRS:
                continue
            rel = token.rstrip("/.:")
            if not (root / rel).exists():
                out.append(f"{name}: `{token}` does not exist in the repository")
    return out


def _repository_files(root: Path) -> list[Path]:
    """Files under the repository, skipping hidden folders (.git, .venv) and run outputs."""
    skip = {"runs", "__pycache__", "node_modules", "build", "dist"}
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip]
        found.extend(Path(dirpath) / f for f in filenames)
    return found


def test_team_notes_are_gone() -> None:
    found = [
        p.relative_to(ROOT).as_posix() for p in _repository_files(ROOT) if p.name in TEAM_NOTES
    ]
    assert found == [], f"team notes are not product docs: {found}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_names_only_files_in_the_repository(path: Path) -> None:
    assert problems(path) == []


def test_readme_lists_every_doc() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [
        p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"`docs/{p.name}`" not in readme
    ]
    assert missing == [], f"README.md does not list {missing}"


def test_the_scan_finds_each_kind_of_bad_reference(tmp_path: Path) -> None:
    """The scan is not vacuous: a doc with one bad reference of each kind gets one problem each."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "real.py").write_text("")
    (tmp_path / "docs" / "ok.md").write_text("")
    doc = tmp_path / "docs" / "bad.md"
    doc.write_text(
        "See [ok](ok.md), [anchor](#x), [web](https://example.org) and `services/real.py`;\n"
        "`<run_dir>/metrics.jsonl` and `services/{a,b}.py` are placeholders.\n"
        "Bad: [gone](gone.md), `services/missing.py`, the DESIGN.md notes,\n"
        f"see {_UP}shared/notes and {_ABS}main/x.\n",
        encoding="utf-8",
    )
    found = problems(doc, root=tmp_path)
    assert len(found) == 5, found
    joined = "\n".join(found)
    for needle in ("gone.md", "services/missing.py", "DESIGN.md", repr(_UP), repr(_ABS)):
        assert needle in joined, (needle, found)
