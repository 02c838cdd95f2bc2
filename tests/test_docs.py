"""The documentation's cross-references: every ``docs/<name>.md, "<section>"`` or ``README.md, "<section>"`` in the
docs, the README and the code names a section that exists there, as a heading or a bold paragraph's lead, so a
reader who follows one lands somewhere (a section renamed without its references fails here)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: ``docs/performance.md, "The generator process started early"``: the document, then the section in quotes (a line
#: break inside either allowed; a code comment's ``#:`` continuation dropped before matching).
REFERENCE = re.compile(r'(docs/[\w-]+\.md|README\.md)["`]?,\s*"([^"]+)"')


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[`*]", "", text)).strip().lower()


def _sections(doc: Path) -> list[str]:
    """Each heading's text and each bold paragraph's or item's lead (``**What fits on one 80 GB GPU, per step.**``)."""
    text = doc.read_text()
    heads = [line.lstrip("#") for line in text.splitlines() if line.startswith("#")]
    leads = re.findall(r"(?:^|\n)\s*(?:[-*] )?\*\*([^*]+)\*\*", text)
    return [_plain(s) for s in heads + leads]


def _references() -> list[tuple[str, str, str]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += [p for d in ("rlcore", "tasks", "flows", "infra") for p in sorted((ROOT / d).rglob("*.py"))]
    out = []
    for f in files:
        text = re.sub(r"\n\s*#:?", "\n", f.read_text())  # comment continuations
        out += [(str(f.relative_to(ROOT)), doc, title) for doc, title in REFERENCE.findall(text)]
    return out


def test_the_checker_reads_references_and_sections():
    assert any(doc == "docs/benchmarks.md" and title == "Every idea tried" for _, doc, title in _references())
    assert "every idea tried" in _sections(ROOT / "docs" / "benchmarks.md")


def test_every_reference_to_a_section_names_one_that_exists():
    sections = {}
    missing = []
    for where, doc, title in _references():
        path = ROOT / doc
        if doc not in sections:
            sections[doc] = _sections(path) if path.exists() else []
        wanted = _plain(title)
        if not any(s.startswith(wanted) for s in sections[doc]):
            missing.append(f'{where}: {doc}, "{title}"')
    assert not missing, "references to sections that do not exist:\n" + "\n".join(missing)
