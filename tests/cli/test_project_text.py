"""The project's files speak only of the project.

Two checks over the text files of README.md, CHANGELOG.md, docs/, benchmarks/ (result files
included), src/ and tests/:

* no line speaks of how the work was organised, as :data:`HISTORY` spells it: working periods,
  numbered runs on a device, tracker numbers (history lives in git, not in the files);
* every repository path a document or a source file names (``benchmarks/offload.py``,
  ``docs/format.md``) exists, so moving a file cannot leave a stale reference behind. Result
  files are left out of this one: they record the commands that made them, as run.

Each failure names ``file:line`` and the offending text.
"""

from __future__ import annotations

import re
from pathlib import Path


def _root() -> Path:
    here = Path(__file__).resolve().parent
    for d in (here, *here.parents):
        if (d / "pyproject.toml").is_file():
            return d
    raise RuntimeError(f"no pyproject.toml above {here}")


ROOT = _root()
SCANNED = ("README.md", "CHANGELOG.md", "docs", "benchmarks", "src", "tests")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis"}
BINARY_SUFFIXES = {".png", ".jpg", ".pdf", ".safetensors", ".pt", ".pyc", ".whl"}

# The alternatives are spelled with character classes so that this file does not match itself.
HISTORY = re.compile(
    r"\bs[e]ssions?\b"
    r"|\b(?:second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) c[a]lls?\b"
    r"|\b(?:device|gpu) c[a]lls?\b"
    r"|\bc[a]lls? \d+\b"
    r"|(?<![a-z])c[a]ll\d+(?![a-z])"
    r"|\bi[s]sues? #?\d+"
    r"|\b(?:pr|pull request) #\d+",
    re.IGNORECASE,
)
# A path from the repository root, as docs and comments name files; one a command is told to
# write (``--out PATH``, ``| tee PATH``) need not exist yet.
PATH = re.compile(r"(?<![\w./-])((?:benchmarks|docs|src|tests)/[\w./-]*\w\.(?:py|md|sh|json|png|txt))\b")
OUTPUT = re.compile(r"(?:--out|--plot|tee|>)[ =]$")


def _text_files() -> list[Path]:
    files = []
    for name in SCANNED:
        top = ROOT / name
        candidates = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        for f in candidates:
            parts = f.relative_to(ROOT).parts
            if (f.is_file() and f.suffix not in BINARY_SUFFIXES
                    and not SKIPPED_DIRS.intersection(parts)
                    and not any(p.endswith(".egg-info") for p in parts)):  # built, not written
                files.append(f)
    return files


def _lines(path: Path) -> list[str]:
    data = path.read_bytes()
    if b"\0" in data:
        return []
    return data.decode("utf-8", errors="replace").splitlines()


def _is_result(path: Path) -> bool:
    return path.relative_to(ROOT).parts[:2] == ("benchmarks", "results")


def test_the_scan_sees_the_project():
    names = {f.relative_to(ROOT).as_posix() for f in _text_files()}
    assert "README.md" in names and "tests/cli/test_project_text.py" in names, sorted(names)[:20]
    assert any(n.startswith("src/shardopt/") for n in names)
    assert any(n.startswith("docs/") for n in names)


def test_no_file_speaks_of_sessions_calls_or_issue_numbers():
    found = []
    for f in _text_files():
        rel = f.relative_to(ROOT).as_posix()
        if HISTORY.search(rel):
            found.append(f"{rel}: the file name")
        for no, line in enumerate(_lines(f), 1):
            m = HISTORY.search(line)
            if m:
                found.append(f"{rel}:{no}: {m.group(0)!r} in {line.strip()[:120]!r}")
    assert not found, ("say what is, not how the work went (history lives in git):\n"
                       + "\n".join(found))


def test_the_patterns_catch_what_they_are_for():
    # The check above is only as good as its patterns: each of these must be caught, and the
    # plain uses of the same words must not.
    caught = ["the 3rd run (" + "sev" + "enth sess" + "ion)", "see iss" + "ue 14", "the thi" + "rd call",
              "GPU c" + "all 3 ran it", "results/c" + "all2.log", "device c" + "alls",
              "Sess" + "ions of work"]
    passed = ["a function call returns", "call_s", "recall 0.9", "tissue 3",
              "start_new_session=True", "the first " + "call to step()", "issues a collective"]
    assert all(HISTORY.search(s) for s in caught), [s for s in caught if not HISTORY.search(s)]
    assert not any(HISTORY.search(s) for s in passed), [s for s in passed if HISTORY.search(s)]


def test_every_path_a_file_names_exists():
    missing = []
    for f in _text_files():
        if _is_result(f):
            continue
        rel = f.relative_to(ROOT).as_posix()
        for no, line in enumerate(_lines(f), 1):
            for m in PATH.finditer(line):
                if not OUTPUT.search(line[:m.start()]) and not (ROOT / m.group(1)).exists():
                    missing.append(f"{rel}:{no}: {m.group(1)}")
    assert not missing, "these files name paths that do not exist:\n" + "\n".join(missing)
