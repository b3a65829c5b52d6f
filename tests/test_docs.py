"""Every tracked text file names only paths inside the repository, and only files that exist.

A plain scan, no markdown parser, over `git ls-files` (code, comments, deploy READMEs,
examples, the docs):

* a relative markdown link (in `*.md` files) must resolve to a file in the repository;
* a repository path written in backticks (one that starts with a top-level folder such as
  `services/` or `docs/` and carries no placeholder like `<run_dir>` or `{a,b}`) must exist;
* a bare repository path (in a comment, a docstring, a shell script) whose folder exists must
  name a file or folder in it (a path into a folder the repository does not have is left
  alone: most are citations of another project's tree, such as AReaL's examples);
* a parent-folder path must stay inside the repository and resolve to something, and the
  absolute checkout folder of a development machine must not appear at all;
* the team-note files that once lived in docs/ must not come back.

A path cited as another project's file (`AReaL's \\`examples/...\\``) is not checked, and a
few deliberate bad paths in tests (inputs the code must refuse) are listed in `ALLOWED`.
The patterns and the team-note names are spelled in pieces, so this file passes its own scan.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Notes about how the code was written, not documentation: none of them may exist or be named.
TEAM_NOTES = ("HELPERS" + "-brief.md", "CONTRACTS" + "-internal.md", "DESIGN" + ".md")

_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)[^)]*\)")
_CODE = re.compile(r"`([^`\n]+)`")
_SPLIT = re.compile(r"[\s=,;()\"']+")
_PLACEHOLDER = re.compile(r"[<>{}*$\[\]%]")
# Absolute paths of the machine the code was written on, and escapes from the repository.
# Spelled in pieces so that this file itself holds no such path.
_UP = "." + "./"
_ABS = "/" + "work/"
_PARENT = re.compile(r"(?<![\w.])((?:" + re.escape(_UP) + r")+)([\w.\-/]*)")
_MACHINE = re.compile(r"(?<![\w.])" + re.escape(_ABS))
# Another project named just before a path: the path is a citation of that project's tree.
_CITED = re.compile(
    r"\b(?:AReaL|SGLang|verl|prime-rl|torchtune|CleanRL|vLLM)(?:'s|’s)?(?: own)?\s*\(?\s*`?$"
)

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
_BARE = re.compile(
    r"(?<![\w./\-@:`])((?:"
    + "|".join(re.escape(d) for d in sorted(REPO_DIRS))
    + r")/[\w./\-{}<>*$\[\]%]*)"
)

# (file, exact string, why): deliberate bad paths, inputs a test feeds the code to refuse.
ALLOWED: tuple[tuple[str, str, str], ...] = (
    (
        "tests/buffer/test_servicer.py",
        _UP + _UP + "etc/evil.jsonl",
        "an export path the buffer must refuse",
    ),
    ("tests/test_cli.py", "examples" + "/does-not-exist.yaml", "a config file the CLI must refuse"),
)


def tracked_text_files(root: Path = ROOT) -> list[Path]:
    """Every text file git tracks (a checkout without git: every file outside hidden and
    build folders)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True
        ).stdout
        paths = [root / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = _repository_files(root)
    return [p for p in paths if _is_text(p)]


def _is_text(path: Path) -> bool:
    if not path.is_file():  # deleted in the working tree
        return False
    data = path.read_bytes()
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _cited(text: str, start: int) -> bool:
    line_start = text.rfind("\n", 0, start) + 1
    return bool(_CITED.search(text[line_start:start]))


def _allowed(name: str, token: str) -> bool:
    return any(name == f and token.startswith(s) for f, s, _ in ALLOWED)


def _relative_problem(path: Path, target: str, root: Path) -> str:
    """What is wrong with a path relative to `path`'s folder ('' when nothing)."""
    resolved = (path.parent / target).resolve()
    if not resolved.is_relative_to(root):
        return "leaves the repository"
    return "" if resolved.exists() else "points to nothing"


def problems(path: Path, root: Path = ROOT) -> list[str]:
    """Every bad reference in one file, as `file:line: what`."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(root).as_posix()
    out: list[str] = []

    def line(pos: int) -> int:
        return text[:pos].count("\n") + 1

    for note in TEAM_NOTES:
        if note in text:
            out.append(f"{name}:{line(text.index(note))}: names the team note {note}")
    for m in _MACHINE.finditer(text):
        out.append(f"{name}:{line(m.start())}: a path outside the repository ({_ABS!r})")
    for m in _PARENT.finditer(text):
        token = m.group(0).rstrip(".:,")
        if _allowed(name, token):
            continue
        bad = _relative_problem(path, token, root)
        if bad:
            out.append(f"{name}:{line(m.start())}: {token!r} {bad}")
    if path.suffix == ".md":
        for m in _LINK.finditer(text):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # anchor, http:, mailto:
                continue
            bad = _relative_problem(path, target, root)
            if bad:
                out.append(f"{name}:{line(m.start())}: link {target!r} {bad}")
    for m in _CODE.finditer(text):
        if _cited(text, m.start()):
            continue
        for token in _SPLIT.split(m.group(1)):
            token = token.removeprefix("./")
            if "/" not in token or _PLACEHOLDER.search(token):
                continue
            if token.split("/", 1)[0] not in REPO_DIRS or _allowed(name, token):
                continue
            rel = token.rstrip("/.:")
            if not (root / rel).exists():
                out.append(f"{name}:{line(m.start())}: `{token}` does not exist in the repository")
    for m in _BARE.finditer(text):
        token = m.group(1)
        if _PLACEHOLDER.search(token) or _cited(text, m.start()) or _allowed(name, token):
            continue
        rel = token.rstrip("/.:,")
        if not (root / rel).parent.is_dir() or (root / rel).exists():
            continue
        out.append(f"{name}:{line(m.start())}: {rel} does not exist in the repository")
    return sorted(set(out))


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


def test_the_scan_covers_code_docs_deploy_and_examples() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in tracked_text_files()}
    for expected in ("README.md", "docs/config.md", "services/cli.py", "tests/test_docs.py"):
        assert expected in names, expected
    for folder in ("deploy/", "examples/", "tools/"):
        assert any(n.startswith(folder) for n in names), folder


@pytest.mark.parametrize("path", tracked_text_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_file_names_only_paths_in_the_repository(path: Path) -> None:
    assert problems(path) == []


def test_allowed_bad_paths_are_still_there() -> None:
    """An allowance whose string is gone from its file would silently widen the scan."""
    for file, string, why in ALLOWED:
        assert string in (ROOT / file).read_text(encoding="utf-8"), (file, string, why)


def test_readme_lists_every_doc() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [
        p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"`docs/{p.name}`" not in readme
    ]
    assert missing == [], f"README.md does not list {missing}"


def test_the_scan_finds_each_kind_of_bad_reference(tmp_path: Path) -> None:
    """The scan is not vacuous: a doc with one bad reference of each kind gets one problem
    each, and the good references, placeholders and citations get none."""
    svc = "services"
    (tmp_path / "docs").mkdir()
    (tmp_path / svc).mkdir()
    (tmp_path / svc / "real.py").write_text("")
    (tmp_path / "docs" / "ok.md").write_text("")
    doc = tmp_path / "docs" / "bad.md"
    tick = "`"
    doc.write_text(
        f"See [ok](ok.md), [anchor](#x), [web](https://example.org), {tick}{svc}/real.py{tick}"
        f" and {_UP}{svc}/real.py;\n"
        f"{tick}<run_dir>/metrics.jsonl{tick} and {tick}{svc}/{{a,b}}.py{tick} are placeholders;"
        f" AReaL's {tick}examples/math/x.yaml{tick} and examples/math/y.yaml are citations.\n"
        f"Bad: [gone](gone.md), {tick}{svc}/missing.py{tick}, the {TEAM_NOTES[2]} notes,\n"
        f"see {_UP}{_UP}shared/notes, {_ABS}main/x and {_UP}nothing.md;"
        f" {svc}/bare_missing.py in prose.\n",
        encoding="utf-8",
    )
    found = problems(doc, root=tmp_path)
    assert len(found) == 7, found
    joined = "\n".join(found)
    for needle in (
        "gone.md",
        f"{svc}/missing.py",
        TEAM_NOTES[2],
        repr(_UP + _UP + "shared/notes"),
        repr(_ABS),
        repr(_UP + "nothing.md"),
        f"{svc}/bare_missing.py",
    ):
        assert needle in joined, (needle, found)
    # The same text in a code file: links are a markdown form, so the link to gone.md is not
    # one there; everything else is still found.
    code = tmp_path / svc / "bad.py"
    code.write_text(doc.read_text(encoding="utf-8"), encoding="utf-8")
    found_in_code = problems(code, root=tmp_path)
    assert not any("gone.md" in p for p in found_in_code), found_in_code
    assert len(found_in_code) == 6, found_in_code
