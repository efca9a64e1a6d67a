"""The README is a product document: short, its set-up commands first, every link alive, its
spec example a valid spec; the product docs carry no issue numbers, run dates or
work-tracking words (history belongs in docs/JOURNAL.md)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 500
# Documents a user reads; docs/JOURNAL.md (the history) may hold dates and work-tracking words.
PRODUCT_DOCS = ["README.md", "docs/PERFORMANCE.md", "docs/ARCHITECTURE.md", "docs/KERNELS.md",
                "docs/SERVING.md", "docs/DEPLOY.md",
                "ci/README.md"]
MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
FORBIDDEN = {
    "an issue number": re.compile(r"\bissues?\s+\d+", re.I),
    "an issue reference": re.compile(r"(?<![\w&/#])#\d+\b"),
    "a work-tracking word": re.compile(
        r"\b(this|night|morning|midday|afternoon|evening|last) stop\b|\(in progress\)", re.I),
    "a date": re.compile(rf"\b\d{{1,2}} (?:{MONTHS})[a-z]*\b(?: 20\d\d)?|\b20\d\d-\d\d-\d\d\b"),
    "a time of day": re.compile(r"\b\d\d:\d\d ?utc\b", re.I),
}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def commands(body: str) -> list[str]:
    """The command lines of a shell block, comments and blank lines dropped."""
    lines = (line.split("#", 1)[0].strip() for line in body.splitlines())
    return [line for line in lines if line]


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_readme_is_at_most_500_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines (at most {MAX_README_LINES}): move measurements to "
        "docs/PERFORMANCE.md and history to docs/JOURNAL.md")


def test_readme_starts_with_the_two_set_up_commands():
    shell = [commands(body) for lang, body in fenced_blocks(README.read_text())
             if lang in ("bash", "sh", "shell")]
    first = [c for block in shell for c in block][:2]
    assert first == ["bash scripts/demo.sh", "bash scripts/test.sh"], first
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert (ROOT / script).is_file(), script


@pytest.mark.parametrize("doc", PRODUCT_DOCS)
def test_product_docs_hold_no_issue_numbers_dates_or_work_tracking(doc):
    text = (ROOT / doc).read_text()
    found = [f"line {text.count(chr(10), 0, m.start()) + 1}: {what} {m.group(0)!r}"
             for what, pattern in FORBIDDEN.items() for m in pattern.finditer(text)]
    assert not found, f"{doc} (history goes to docs/JOURNAL.md): " + "; ".join(found)


@pytest.mark.parametrize("doc", PRODUCT_DOCS)
def test_every_relative_link_points_to_something_that_exists(doc):
    path = ROOT / doc
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue                                    # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc}: " + "; ".join(broken)


def test_readme_spec_example_is_a_valid_spec():
    from kiln.builder.spec import parse_spec

    specs = [body for lang, body in fenced_blocks(README.read_text())
             if lang == "yaml" and body.startswith("name:")]
    assert specs, "README.md shows no spec (a yaml block starting with name:)"
    for body in specs:
        parse_spec(body, "README.md")
