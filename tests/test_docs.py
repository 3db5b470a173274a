"""README.md is a user guide that stays true: its links resolve, it stays short, and the files it
names exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")


def test_readme_links_resolve():
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.*)$", README, re.M)}
    for target in re.findall(r"\]\(([^)]+)\)", README):
        if target.startswith("#"):
            assert target[1:] in anchors, target
        elif not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_readme_is_a_short_guide_with_contents():
    assert len(README.splitlines()) <= 450
    assert "## Contents" in README and "../shared" not in README


def test_files_the_docs_name_exist():
    for doc in (README, (ROOT / "docs" / "design.md").read_text()):
        for path in set(re.findall(r"`((?:hpcps|scripts|slurm|examples|tests|docs)/[\w./-]+)`", doc)):
            if "NAME" not in path:                  # a pattern, as in scripts/bench_NAME.py
                assert (ROOT / path.rstrip("/")).exists(), path
