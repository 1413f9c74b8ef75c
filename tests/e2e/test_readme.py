"""The commands of the README and the guides (docs/guide/), read as a new user follows them after
``make demo`` (issue 42.1): none reuses the demo's run (``runs/quickstart``: refused, and
``--overwrite`` would delete it), and what a later command reads (``export --merge runs/X``,
``serve --run-dir runs/X``) is a run an earlier command of the same page (or of the README) made,
of the right kind. The pages are found wherever the commands move (issue 65)."""

from __future__ import annotations

import re
import shlex

import yaml

from tests.conftest import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs" / "guide").glob("*.md"))]
RUN = re.compile(r"\basyncrl (run|learn)\b")


def _commands(page=README) -> list[list[str]]:
    """Every shell command of a page's ``bash`` blocks (continuation lines joined, comments
    and environment assignments dropped), as argument lists."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words:
                out.append(words)
    return out


def _name(words: list[str]) -> str | None:
    """The run's name: a ``name=`` override, else the config file's ``name`` (None: neither)."""
    given = next((w.split("=", 1)[1] for w in words if w.startswith("name=")), None)
    if given is not None:
        return given
    for flag in ("-c", "--config"):
        if flag in words:
            return (yaml.safe_load((ROOT / words[words.index(flag) + 1]).read_text()) or {}).get("name")
    return None


def test_no_readme_command_reuses_or_overwrites_the_demos_run():
    runs = [w for page in PAGES for w in _commands(page) if RUN.search(" ".join(w))]
    assert len(runs) >= 8, runs  # (the parser found the pages' runs)
    for words in runs:
        line = " ".join(words)
        assert "--overwrite" not in words, line
        assert _name(words) not in (None, "quickstart"), f"runs/quickstart is the demo's run: {line}"


def test_what_a_readme_command_reads_is_a_run_made_before_it():
    readme = _made(_commands(README), {})
    for page in PAGES[1:]:
        _made(_commands(page), dict(readme), page.name)


def _made(commands: list[list[str]], made: dict[str, str], where: str = "README.md") -> dict[str, str]:
    """The runs ``commands`` make, in order (starting from ``made``), checking that each run a command
    reads was made before it."""
    for words in commands:
        line = f"{where}: " + " ".join(words)
        if RUN.search(line) and _name(words):
            made.setdefault(_name(words), line)
        for flag in ("--merge", "--run-dir"):
            if flag in words:
                target = words[words.index(flag) + 1] if flag == "--run-dir" else words[-1]
                name = target.removeprefix("runs/")
                assert name in made, f"{line}: no earlier command makes runs/{name}"
                if flag == "--merge":
                    assert "model.lora" in made[name], f"{line}: runs/{name} trains no LoRA adapters"
        if len(words) > 2 and words[1:2] == ["replay"]:  # asyncrl replay runs/X: an archived run made before
            name = words[2].removeprefix("runs/")
            assert name in made, f"{line}: no earlier command makes runs/{name}"
            assert "log.archive_episodes=true" in made[name], f"{line}: runs/{name} keeps no episode archive"
    return made
