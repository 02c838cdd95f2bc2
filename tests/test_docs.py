"""The documentation's cross-references: every ``docs/<name>.md, "<section>"`` or ``README.md, "<section>"`` in the
docs, the README, the code and the tests names a section that exists there, as a heading or a bold paragraph's lead,
and every path of this repository they name exists, so a reader who follows one lands somewhere (a section renamed
or a file moved without its references fails here)."""

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


#: A path of this repository as the docs and the code name one (``tasks/data/sandbox.py``,
#: ``conf/bench/grpo_screen.yaml``).
PATH = re.compile(r"\b((?:rlcore|tasks|flows|infra|conf|tests|docs|assets)/[\w./-]+\.(?:py|md|yaml|sh|json|png))\b")
#: Named as a pattern, not as a file: ``conf/bench/ARM.yaml`` (any arm's file).
PLACEHOLDERS = {"conf/bench/ARM.yaml"}


def _files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += [p for d in ("rlcore", "tasks", "flows", "infra", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    return [f for f in files if f != Path(__file__).resolve()]  # this file's examples are patterns


def _references() -> list[tuple[str, str, str]]:
    out = []
    for f in _files():
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


def test_every_path_the_docs_and_the_code_name_exists():
    missing = sorted({f"{f.relative_to(ROOT)}: {p}" for f in _files() for p in PATH.findall(f.read_text())
                      if p not in PLACEHOLDERS and not (ROOT / p).exists()})
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)
