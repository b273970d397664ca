"""The CLI surface: help, version, lazy imports, completion, and dtrain init."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dtrain import __version__
from tests.conftest import REPO, drive_prompts, run_dtrain

COMMANDS = ["init", "mine", "validate", "status", "push", "benchmark-bandwidth", "sandbox"]
HEAVY = ["torch", "hivemind", "transformers", "datasets", "bittensor"]


def test_help_lists_all_seven_subcommands():
    result = run_dtrain("--help")
    assert result.returncode == 0
    for cmd in COMMANDS:
        assert cmd in result.stdout


def test_version():
    result = run_dtrain("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"dtrain {__version__}"


def _imported_modules(argv: list[str], env: dict | None = None) -> set[str]:
    """Modules loaded by a CLI invocation, read from the interpreter itself at exit."""
    code = (
        "import atexit, sys, json\n"
        "out = sys.argv[1]\n"
        "atexit.register(lambda: open(out, 'w').write(json.dumps(sorted(sys.modules))))\n"
        "args = sys.argv[2:]; sys.argv = ['dtrain'] + args\n"
        "from dtrain.cli.app import main\n"
        "main()\n"
    )
    out = REPO / ".pytest_cache" / f"mods-{os.getpid()}.json"
    out.parent.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-c", code, str(out), *argv], env={**os.environ, **(env or {})},
                   capture_output=True, text=True, timeout=60)
    mods = set(json.loads(out.read_text()))
    out.unlink()
    return mods


@pytest.mark.parametrize("argv", [["--help"]] + [[cmd, "--help"] for cmd in COMMANDS])
def test_help_does_not_import_heavy_modules(argv):
    mods = _imported_modules(argv)
    assert "dtrain.cli.app" in mods  # the probe really ran the CLI
    leaked = [m for m in HEAVY if m in mods]
    assert leaked == [], f"`dtrain {' '.join(argv)}` imported {leaked}"


def test_completion_does_not_import_heavy_modules():
    env = {"_DTRAIN_COMPLETE": "complete_bash", "COMP_WORDS": "dtrain sandbox --adv", "COMP_CWORD": "2"}
    mods = _imported_modules([], env=env)
    assert "dtrain.cli.app" in mods
    assert [m for m in HEAVY if m in mods] == []


def _complete(words: str, cword: int) -> list[str]:
    env = {**os.environ, "_DTRAIN_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    result = subprocess.run([sys.executable, "-m", "dtrain"], env=env, capture_output=True, text=True, timeout=60)
    return result.stdout.split()


def test_completion_offers_subcommands_and_values():
    assert _complete("dtrain bench", 1) == ["benchmark-bandwidth"]
    assert _complete("dtrain sandbox --adversary free", 3) == ["freeloader"]
    assert _complete("dtrain mine --network san", 3) == ["sandbox"]


def test_sandbox_offers_every_adversary_kind():
    from dtrain.cli.sandbox import ADVERSARIES
    from dtrain.sandbox.adversary import KINDS

    assert ADVERSARIES == KINDS


def test_sandbox_offers_every_model_preset_at_a_sandbox_scale():
    from dtrain.cli.sandbox import MODELS
    from dtrain.sandbox.settings import SANDBOX_SCALES
    from dtrain.training.models import PRESETS

    assert MODELS == tuple(PRESETS) == tuple(SANDBOX_SCALES)
    assert _complete("dtrain sandbox --model gpt2-1", 3) == ["gpt2-124m", "gpt2-1b"]


def test_sandbox_rejects_an_unknown_model_by_name(clean_env):
    result = subprocess.run([sys.executable, "-m", "dtrain", "sandbox", "--model", "gpt3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "gpt3" in result.stderr and "gpt2-124m" in result.stderr


def test_completion_scripts_are_current():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_completions.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_init_no_prompt_writes_valid_toml(clean_env):
    path = clean_env / "cfg" / "config.toml"
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--role", "miner", "--netuid", "38",
                        "--network", "sandbox", "--wallet", "w1", "--wallet-hotkey", "h1")
    assert result.returncode == 0, result.stderr
    assert str(path) in result.stdout
    doc = tomllib.loads(path.read_text())
    assert doc["chain"]["netuid"] == 38 and doc["chain"]["network"] == "sandbox"
    assert doc["node"]["role"] == "miner" and doc["wallet"] == {"name": "w1", "hotkey": "h1",
                                                                 "path": "~/.bittensor/wallets"}
    assert "validator" not in doc  # a miner's file holds a miner's sections
    # The written file loads back through the strict loader.
    assert run_dtrain("init", "--no-prompt", "--config", str(path)).returncode == 1


def test_init_refuses_to_overwrite_without_force(clean_env):
    path = clean_env / "config.toml"
    path.write_text("# hand-tuned\n")
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--role", "validator")
    assert result.returncode != 0
    assert "--force" in result.stderr
    assert path.read_text() == "# hand-tuned\n"
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--role", "validator", "--force")
    assert result.returncode == 0
    assert tomllib.loads(path.read_text())["node"]["role"] == "validator"


def test_init_warns_about_missing_wallet_with_btcli_line(clean_env):
    path = clean_env / "config.toml"
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--wallet", "cold", "--wallet-hotkey", "hot",
                        env={"HOME": str(clean_env / "home")})
    assert result.returncode == 0
    assert "btcli wallet create --wallet cold --wallet-hotkey hot" in result.stderr


def test_init_quiet_when_wallet_exists(clean_env):
    wallets = clean_env / "wallets"
    (wallets / "cold" / "hotkeys").mkdir(parents=True)
    (wallets / "cold" / "coldkeypub.txt").write_text("{}")
    (wallets / "cold" / "hotkeys" / "hot").write_text("{}")
    path = clean_env / "config.toml"
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--wallet", "cold", "--wallet-hotkey", "hot",
                        "--wallet-path", str(wallets))
    assert result.returncode == 0 and "warning" not in result.stderr


def test_init_rejects_bad_role(clean_env):
    result = run_dtrain("init", "--no-prompt", "--config", str(clean_env / "c.toml"), "--role", "farmer")
    assert result.returncode == 2
    assert "node.role" in result.stderr and "farmer" in result.stderr
    assert not (clean_env / "c.toml").exists()


def test_init_uses_env_defaults(clean_env):
    path = clean_env / "c.toml"
    result = run_dtrain("init", "--no-prompt", "--config", str(path), env={"BT_WALLET": "fromenv"})
    assert result.returncode == 0
    assert tomllib.loads(path.read_text())["wallet"]["name"] == "fromenv"


def test_init_interactive_prompts_on_a_terminal(clean_env):
    """Drive the prompts through a real pseudo-terminal, as an operator would."""
    path = clean_env / "c.toml"
    # the last two: no public address yet, no announce multiaddr (a validator on test is asked both)
    code, transcript = drive_prompts(["init", "--config", str(path)], ["validator", "test", "7", "cold", "hot", "", ""])
    assert code == 0, transcript
    doc = tomllib.loads(path.read_text())
    assert doc["node"]["role"] == "validator" and doc["chain"]["network"] == "test"
    assert doc["chain"]["netuid"] == 7 and doc["wallet"]["name"] == "cold" and doc["wallet"]["hotkey"] == "hot"


def test_mine_and_validate_share_the_node_options():
    """The shared options are declared once (dtrain.cli.node_options) and reach the config."""
    from dtrain.cli.mine import mine
    from dtrain.cli.node_options import NodeOptions
    from dtrain.cli.validate import validate

    shared = [f.name for f in dataclasses.fields(NodeOptions)]
    for command in (mine, validate):
        params = list(inspect.signature(command).parameters)
        assert params[:len(shared)] == shared, command.__name__
    assert "round_interval" in inspect.signature(validate).parameters
    assert "repo" not in inspect.signature(validate).parameters
    node = NodeOptions(network="test", netuid=7, device="cpu", data_dir=Path("/tmp/d"), log_format="json")
    overrides = node.overrides()
    assert overrides["chain.network"] == "test" and overrides["chain.netuid"] == 7
    assert overrides["training.device"] == "cpu" and overrides["node.data_dir"] == "/tmp/d"
    assert overrides["node.log_format"] == "json" and overrides["wallet.name"] is None


def test_node_option_flags_reach_the_config_of_both_commands(clean_env):
    """A bad value for a shared flag is reported against that flag by mine and by validate."""
    for command in ("mine", "validate"):
        result = run_dtrain(command, "--network", "sandbox", "--netuid", "70000", "--no-dashboard")
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert "flag --netuid" in result.stderr and "chain.netuid" in result.stderr


def test_init_gives_a_validator_the_training_section(clean_env):
    path = clean_env / "v.toml"
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--role", "validator",
                        "--network", "sandbox")
    assert result.returncode == 0, result.stderr
    doc = tomllib.loads(path.read_text())
    assert "training" in doc and "validator" in doc and "miner" not in doc
    assert doc["training"]["local_batch_size"] == 64
