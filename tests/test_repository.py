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


def test_core_never_imports_the_cli_or_rich():
    """The layering docs/architecture.md promises: only dtrain.cli and dtrain.ui may import
    the CLI toolkit or Rich, and nothing outside dtrain.cli imports dtrain.cli."""
    import ast

    ui_only = {"rich", "typer", "click", "shellingham"}
    offenders = []
    for path in sorted((REPO / "dtrain").rglob("*.py")):
        package = path.relative_to(REPO / "dtrain").parts[0]
        if package in ("cli", "ui", "__main__.py"):  # __main__ is `python -m dtrain`, the CLI's entry
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in ui_only or name.startswith(("dtrain.cli", "dtrain.ui")):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert not offenders, offenders


def test_operators_link_table_is_current_and_counts_gpt2_parameters_exactly():
    """docs/operators.md's link table is generated; its parameter formula matches real models."""
    import subprocess
    import sys

    from dtrain.training.models import count_parameters, create_model

    result = subprocess.run([sys.executable, "scripts/gen_link_table.py", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from gen_link_table import gpt2_params
    finally:
        sys.path.pop(0)
    model = create_model("tiny", vocab_size=300, n_positions=64, seed=0)
    cfg = model.config
    assert gpt2_params(cfg.n_layer, cfg.n_embd, cfg.n_positions, vocab=300) == count_parameters(model)
