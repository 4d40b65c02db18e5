"""The repository's text says what zinf is, never how it was made.

Every tracked text file (``git ls-files``: docs, code, tests, configs, raw benchmark rows) is searched for words
that only mean something to the people who wrote it:

- a work session: "the session that built this", "third session", "an earlier session" (a determiner or an
  ordinal right before the word); a POSIX process session, pytest's session and identifiers such as
  ``start_new_session`` or ``scope="session"`` are not matched;
- a number of this project's issues: "issue 13", "issues 13 and 24", "the issue's targets"; an upstream bug is
  fine when its project is named just before it ("torch issue 12345") or it is a link (``.../issues/123``);
- first-person talk about the work: "of mine", "the team"; and "mine" on its own in prose (Markdown, comments),
  where code may still name a rank's own slice ``mine``.

A failure lists every hit as ``path:line: the words found | the line``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Folders left out of the scan, as repository paths ending in "/" (none: every tracked file is searched).
NOT_SCANNED: tuple[str, ...] = ()

_DETERMINERS = (r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th)|last|"
                r"previous|earlier|later|next|this|that|same|another|each|every|one|a|an|the|our|my|work|working|"
                r"coding|development")
SESSION = re.compile(rf"\b(?:{_DETERMINERS})\s+(?:work(?:ing)?\s+)?sessions?\b(?!\s*[=(])", re.IGNORECASE)
ISSUE_NUMBER = re.compile(r"\bissues?\s+(?:no\.?\s*)?#?\d+\b", re.IGNORECASE)
ISSUE_GOALS = re.compile(r"\bthe issue'?s\s+(?:goals?|targets?)\b|\bgoals? of (?:this|the) issue\b", re.IGNORECASE)
UPSTREAM = re.compile(r"(?:torch|pytorch|transformers|accelerate|lightning|deepspeed|trl|peft|gloo|nccl|cpython|"
                      r"python|numpy|glibc|safetensors|hydra|omegaconf|fio|liburing|upstream)\W[^\n]{0,40}$",
                      re.IGNORECASE)
TEAM = re.compile(r"\bof mine\b|\b(?:the|our|my) team\b", re.IGNORECASE)
MINE = re.compile(r"\bmine\b", re.IGNORECASE)
PROSE_SUFFIXES = (".md", ".rst", ".txt")
COMMENT = {".py": "#", ".pyi": "#", ".sh": "#", ".yaml": "#", ".yml": "#", ".toml": "#", ".cpp": "//", ".h": "//",
           ".hpp": "//", ".cc": "//", ".txt": "#"}


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = []
    for name in out.decode().split("\0"):
        if not name or name == THIS_FILE or name.startswith(NOT_SCANNED):
            continue
        path = ROOT / name
        if path.is_file() and b"\0" not in path.read_bytes()[:8192]:
            paths.append(path)
    return paths


def _comment_part(line: str, suffix: str) -> str:
    marker = COMMENT.get(suffix)
    if marker is None or marker not in line:
        return ""
    return line[line.index(marker):]


def hits_in_line(line: str, suffix: str) -> list[str]:
    """The forbidden words in one line of a file with this suffix (``.py``, ``.md``, ...)."""
    found = [m.group(0) for m in SESSION.finditer(line)]
    found += [m.group(0) for m in ISSUE_NUMBER.finditer(line) if not UPSTREAM.search(line[:m.start()])]
    found += [m.group(0) for m in ISSUE_GOALS.finditer(line)]
    found += [m.group(0) for m in TEAM.finditer(line)]
    prose = line if suffix in PROSE_SUFFIXES else _comment_part(line, suffix)
    found += [m.group(0) for m in MINE.finditer(prose)]
    return found


def test_no_words_about_how_the_project_was_made() -> None:
    problems = []
    files = tracked_text_files()
    assert len(files) > 100, f"git ls-files found {len(files)} text files under {ROOT}"
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for words in hits_in_line(line, path.suffix):
                problems.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {words!r} | {line.strip()[:160]}")
    assert not problems, ("words about how the project was made (say what is true of zinf instead):\n"
                          + "\n".join(problems))


@pytest.mark.parametrize("line, suffix", [
    ("written but not run: none was lent to the session that built this.", ".md"),
    ("Measured, 2026-11-26 (third session), every system", ".md"),
    ("the cost of 1.13x an earlier session measured", ".md"),
    ("the fused step of issue 13), so the data", ".md"),
    ("None of this reaches the GPU goals of issue 24", ".md"),
    ("Against the issue's targets:", ".md"),
    ("Some rows ran while short tests of mine ran beside them", ".md"),
    ("    # the team measured this", ".py"),
    ("    # this one is mine", ".py"),
])
def test_the_patterns_find_what_they_are_for(line: str, suffix: str) -> None:
    assert hits_in_line(line, suffix)


@pytest.mark.parametrize("line, suffix", [
    ("@pytest.fixture(scope=\"session\")", ".py"),
    ("def pytest_sessionfinish(session, exitstatus):", ".py"),
    ("Runs are cached per pytest session so that one reference run serves several tests.", ".py"),
    ("running ``cmd``, each in a POSIX session of its own, and watch them.", ".py"),
    ("proc = subprocess.Popen(cmd, start_new_session=True)", ".py"),
    ("mine = self.full[lo : lo + self.shard_numel]", ".py"),
    ("with trainer.accelerator.split_between_processes(PROMPTS) as mine:", ".py"),
    ("a known torch issue 12345 makes gloo abort at exit", ".md"),
    ("see https://github.com/pytorch/pytorch/issues/12345", ".md"),
    ("to determine the shard and examine it", ".md"),
])
def test_the_patterns_leave_other_words_alone(line: str, suffix: str) -> None:
    assert not hits_in_line(line, suffix)


def test_docs_tables_stay_readable() -> None:
    """The README and every page under docs/ keep each table cell under 300 characters (a longer one belongs in the
    text around the table), and the README stays a ten-minute read (at most 250 lines)."""
    long_cells = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("|"):
                long_cells += [f"{path.relative_to(ROOT)}:{number} ({len(cell)} characters)"
                               for cell in line.strip().strip("|").split(" | ") if len(cell) > 300]
    assert not long_cells, "table cells over 300 characters:\n" + "\n".join(long_cells)
    num_lines = len((ROOT / "README.md").read_text().splitlines())
    assert num_lines <= 250, f"README.md has {num_lines} lines; move detail to a page under docs/"
