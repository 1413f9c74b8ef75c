"""The documentation's links (README.md, CONTRIBUTING.md, docs/, examples/): every relative link and
image names a file of the checkout, so moving a page cannot leave a reader at a dead end; and the
docs index names every page under docs/."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "examples").rglob("*.md")),
    ]


def dead_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """``page: target`` for every relative link or image of ``files`` that names no file (code
    blocks aside: they hold no links)."""
    bad = []
    for page in files:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if not re.match(r"^[a-z]+:|^#", target) and not (page.parent / target.split("#", 1)[0]).exists():
                bad.append(f"{page.relative_to(root)}: {target}")
    return bad


def test_every_relative_link_names_a_file():
    assert not (bad := dead_links(pages())), "links to nothing:\n" + "\n".join(bad)


def test_the_checker_finds_a_dead_link(tmp_path):
    page = tmp_path / "a.md"
    page.write_text(
        "see [b](b.md), [c](sub/c.md#x), ![i](img.png), [web](https://x.y), [top](#a)\n```\n[n](no.md)\n```\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("")
    assert dead_links([page], tmp_path) == ["a.md: b.md", "a.md: img.png"]


def test_the_docs_index_names_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [
        str(p.relative_to(ROOT / "docs"))
        for p in sorted((ROOT / "docs").rglob("*.md"))
        if p.name != "README.md" and f"({p.relative_to(ROOT / 'docs')})" not in index
    ]
    assert not missing, f"docs/README.md does not link: {missing}"
