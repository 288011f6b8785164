"""The shell commands of README.md and docs/*.md run as written, from the root of a fresh clone.

Convention for the documentation's fenced code blocks:

- a block fenced as ``bash``, ``sh`` or ``shell`` is a command to run from the repository root; this
  test runs it with ``bash -euo pipefail`` in a fresh clone (the tracked files and the new files git
  does not ignore, as they are in the working tree, and ``.venv`` linked to the virtual environment
  running the tests) and expects exit status 0;
- an HTML comment ``<!-- no-test: WHY -->`` on the line before a block's fence (blank lines allowed
  in between) leaves the block out (``make test`` itself, benchmarks of minutes); the reason is
  required;
- ``<!-- slow: WHY -->`` there runs the block only in ``make test-all`` (the ``slow`` mark);
- blocks fenced otherwise (``python``, ``yaml``, none) are not commands and are not run.

``$AIRFLOW_HOME`` is a fresh temporary directory, so the broker database and the job directories of
``run-local`` land there, and the broker settings of the caller's environment are removed. A block
must write nowhere in the clone that git would report, and never to a fixed path under ``/tmp``
shared by every user (use ``mktemp`` or a relative path).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

SHELL_FENCES = frozenset({"bash", "sh", "shell"})
_MARKER = re.compile(r"<!--\s*(no-test|slow)\s*:\s*(\S.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    doc: str  # path relative to the repository root
    line: int  # line of the opening fence, 1-based
    code: str
    marker: str | None  # "no-test", "slow" or None
    reason: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def shell_blocks(path: Path) -> list[Block]:
    """The shell code blocks of a Markdown file, with the marker before each (if any)."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(```+)\s*(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        if fence.group(2) in SHELL_FENCES:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = _MARKER.search(before)
            blocks.append(Block(str(path.relative_to(REPO)), i + 1, "\n".join(lines[i + 1:end]),
                                marker.group(1) if marker else None, marker.group(2) if marker else ""))
        i = end + 1
    return blocks


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCKS = [b for doc in DOCS for b in shell_blocks(doc)]
RUNNABLE = [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.marker == "slow" else [])
            for b in BLOCKS if b.marker != "no-test"]


def test_the_docs_have_commands_and_each_left_out_one_says_why():
    assert len(RUNNABLE) >= 3  # the parser finds the blocks it is meant to run
    assert {b.doc for b in BLOCKS} >= {"README.md", "docs/simulator.md"}
    for b in BLOCKS:
        if b.marker is not None:
            assert len(b.reason) >= 10, f"{b.id}: say why the block is marked {b.marker}"


def test_no_documented_command_writes_to_a_fixed_shared_path():
    for b in BLOCKS:
        assert not re.search(r"(?<![\w$}])/tmp/", b.code), f"{b.id} uses a fixed path under /tmp: use mktemp"


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone of the repository with the working tree's changes and new files, and ``.venv``."""
    dest = tmp_path_factory.mktemp("clone") / "repo"
    git("clone", "--quiet", "--no-local", str(REPO), str(dest), cwd=REPO)
    changed = git("ls-files", "-z", "--modified", "--others", "--exclude-standard", cwd=REPO).split("\0")
    for name in filter(None, changed):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    (dest / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return dest


def untracked(repo: Path) -> set[str]:
    return set(git("status", "--porcelain", "--untracked-files=all", cwd=repo).splitlines())


@pytest.mark.parametrize("block", RUNNABLE)
def test_a_documented_command_runs_as_written_in_a_fresh_clone(block, clone, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW_ELASTIC_GPU_", "AIRFLOW__", "VIRTUAL_ENV"))}
    env |= {
        "AIRFLOW_HOME": str(tmp_path / "airflow_home"),
        "PYTHONPATH": str(clone),  # the clone's package, not the one the virtual environment points to
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path),
    }
    before = untracked(clone)
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, f"{block.id} failed:\n{block.code}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert untracked(clone) == before, f"{block.id} left files in the repository"
