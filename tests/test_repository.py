"""The repository's promises to a newcomer: README's two commands, CI, changelog."""

from __future__ import annotations

import re

from tests.conftest import REPO


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)
    assert commands[0].endswith("dtrain sandbox")
    assert "pytest" in commands[1]
    for command in commands:
        # The CPU wheel must be installed before the package, or pip pulls CUDA torch.
        assert command.index("torch==2.13.0") < command.index("pip install -q -e")


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (REPO / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci.splitlines()


def test_changelog_keeps_a_changelog_form():
    text = (REPO / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog")
    assert "keepachangelog.com" in text
    assert "## [Unreleased]" in text
