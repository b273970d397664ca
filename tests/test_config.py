"""Config: round trip, precedence, and every error class named with file and key."""

from __future__ import annotations

import pytest

from dtrain.config import (
    Config, ConfigError, SECTIONS, default_config_path, env_name, load_config, read_toml, save_config,
    section_fields, to_toml,
)
from tests.conftest import run_dtrain


def write(path, text):
    path.write_text(text)
    return path


def test_defaults_have_every_documented_section():
    assert list(SECTIONS) == ["wallet", "chain", "node", "model", "data", "training", "miner", "validator",
                              "allreduce", "hub", "api", "dashboard"]
    cfg, used = load_config(None, env={"HOME": "/nonexistent-home"})
    assert used is None
    assert cfg.chain.netuid == 38 and cfg.chain.network == "finney"
    assert cfg.wallet.path == "~/.bittensor/wallets"


def test_round_trip_preserves_every_value(tmp_path):
    cfg = Config()
    cfg.chain.netuid = 7
    cfg.allreduce.initial_peers = ["/ip4/127.0.0.1/tcp/4000/p2p/QmX"]
    cfg.training.lr = 1e-3
    cfg.dashboard.enabled = False
    path = tmp_path / "c.toml"
    save_config(cfg, path)
    loaded, used = load_config(path, env={})
    assert used == path
    assert loaded == cfg


def test_save_refuses_to_overwrite(tmp_path):
    path = write(tmp_path / "c.toml", "# mine\n")
    with pytest.raises(FileExistsError):
        save_config(Config(), path)
    assert path.read_text() == "# mine\n"


def test_precedence_defaults_file_env_flags(tmp_path):
    path = write(tmp_path / "c.toml", "[chain]\nnetuid = 10\nnetwork = \"test\"\n[training]\nlr = 0.5\n")
    env = {"DTRAIN_CHAIN_NETUID": "11", "BT_NETWORK": "local"}
    cfg, _ = load_config(path, env=env)
    assert cfg.chain.netuid == 11          # env beats file
    assert cfg.chain.network == "local"    # BT_NETWORK honoured like btcli
    assert cfg.training.lr == 0.5             # file beats default
    assert cfg.training.micro_batch_size == 8  # default where nothing else speaks
    cfg, _ = load_config(path, env=env, overrides={"chain.netuid": 12, "chain.network": None})
    assert cfg.chain.netuid == 12          # flag beats env
    assert cfg.chain.network == "local"    # a flag that was not given changes nothing


def test_env_dtrain_beats_bt_alias():
    cfg, _ = load_config(None, env={"HOME": "/x", "BT_WALLET": "bt", "DTRAIN_WALLET_NAME": "mine"})
    assert cfg.wallet.name == "mine"


def test_env_parses_types():
    env = {"HOME": "/x", "DTRAIN_DASHBOARD_ENABLED": "false", "DTRAIN_TRAINING_LR": "0.01",
           "DTRAIN_ALLREDUCE_INITIAL_PEERS": "/ip4/1.2.3.4/tcp/1, /ip4/5.6.7.8/tcp/2"}
    cfg, _ = load_config(None, env=env)
    assert cfg.dashboard.enabled is False
    assert cfg.training.lr == 0.01
    assert cfg.allreduce.initial_peers == ["/ip4/1.2.3.4/tcp/1", "/ip4/5.6.7.8/tcp/2"]


def test_config_path_resolution(tmp_path):
    assert default_config_path({"XDG_CONFIG_HOME": "/xdg"}).as_posix() == "/xdg/dtrain/config.toml"
    assert default_config_path({"HOME": "/home/op"}).as_posix() == "/home/op/.config/dtrain/config.toml"
    path = write(tmp_path / "from-env.toml", "[chain]\nnetuid = 99\n")
    cfg, used = load_config(None, env={"DTRAIN_CONFIG": str(path)})
    assert used == path and cfg.chain.netuid == 99


def test_default_file_is_read_when_present(tmp_path):
    xdg = tmp_path / "xdg"
    (xdg / "dtrain").mkdir(parents=True)
    write(xdg / "dtrain" / "config.toml", "[chain]\nnetuid = 5\n")
    cfg, used = load_config(None, env={"XDG_CONFIG_HOME": str(xdg)})
    assert cfg.chain.netuid == 5 and used == xdg / "dtrain" / "config.toml"


@pytest.mark.parametrize("text,key,fragment", [
    ("[chain]\nnetuid = \"abc\"\n", "chain.netuid", "expected an integer, found string 'abc'"),
    ("[chain]\nnetuid = 70000\n", "chain.netuid", "from 0 to 65535, found integer 70000"),
    ("[api]\nport = 70000\n", "api.port", "from 0 to 65535, found integer 70000"),
    ("[training]\nmicro_batch_size = -4\n", "training.micro_batch_size", "found integer -4"),
    ("[validator]\nslice_bytes = 0\n", "validator.slice_bytes", ">= 1"),
    ("[dashboard]\nenabled = \"yes\"\n", "dashboard.enabled", "expected true or false"),
    ("[training]\noptimizer = \"sgd\"\n", "training.optimizer", "expected one of adamw, lamb"),
    ("[chain]\nnetuidd = 3\n", "chain.netuidd", "did you mean 'netuid'"),
    ("[chian]\nnetuid = 3\n", "[chian]", "did you mean 'chain'"),
    ("[allreduce]\ninitial_peers = [1, 2]\n", "allreduce.initial_peers", "expected a list of strings"),
    ("[chain]\nnetwork = \"mainnet\"\n", "chain.network", "found 'mainnet'"),
    # keys of earlier releases say where they went instead of "unknown key"
    ("[miner]\nlr = 0.5\n", "miner.lr", "moved to [training] lr (env DTRAIN_TRAINING_LR)"),
    ("[miner]\ndevice = \"cuda\"\n", "miner.device", "moved to [training] device"),
    ("[allreduce]\nouter_lr = -0.7\n", "allreduce.outer_lr", ">= 0"),
])
def test_errors_name_file_key_expected_and_found(tmp_path, text, key, fragment):
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.key == key
    assert info.value.source == str(path)
    assert fragment in str(info.value)


def test_retired_env_vars_say_where_they_went():
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"HOME": "/x", "DTRAIN_MINER_LOCAL_BATCH_SIZE": "32"})
    assert info.value.source == "env DTRAIN_MINER_LOCAL_BATCH_SIZE"
    assert "moved to [training] local_batch_size (env DTRAIN_TRAINING_LOCAL_BATCH_SIZE)" in str(info.value)


def test_swarm_wide_settings_are_marked():
    from dtrain.config import swarm_settings

    marked = set(swarm_settings(Config()))
    # what peers must agree on: the model, the pages, the optimizer step, the averaging mode
    assert {"model.preset", "model.seq_len", "model.run_id", "data.page_sequences", "data.tokenizer",
            "training.local_batch_size", "training.lr", "training.optimizer", "allreduce.mode"} <= marked
    # what each machine chooses for itself
    assert not marked & {"training.device", "training.precision", "training.micro_batch_size", "api.port",
                         "node.data_dir", "data.local_path", "wallet.name"}


def test_toml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path / "bad.toml", "[chain]\nnetuid = 38\nnetwork = \n")
    with pytest.raises(ConfigError) as info:
        read_toml(path)
    assert "line 3" in str(info.value) and str(path) in str(info.value)


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.toml", env={})
    assert "file not found" in str(info.value) and "absent.toml" in str(info.value)


def test_unknown_dtrain_env_var_is_an_error():
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"HOME": "/x", "DTRAIN_CHAIN_NETUD": "3"})
    assert "DTRAIN_CHAIN_NETUID" in str(info.value)


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"HOME": "/x"}, overrides={"api.port": 70000})
    assert info.value.source == "flag --port" and info.value.key == "api.port"


def test_every_field_has_docs_and_env_name():
    for section in SECTIONS:
        for key, (_, fld) in section_fields(section).items():
            assert fld.metadata["doc"], f"{section}.{key} has no doc"
            assert env_name(section, key) == f"DTRAIN_{section.upper()}_{key.upper()}"


def test_config_reference_doc_is_current():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "configuration.md").read_text()
    for section in SECTIONS:
        for key in section_fields(section):
            assert f"`{env_name(section, key)}`" in doc, f"docs/configuration.md misses {section}.{key}"
    check = subprocess.run([sys.executable, str(root / "scripts" / "gen_config_docs.py"), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


def test_toml_output_is_valid_toml():
    import tomllib

    assert tomllib.loads(to_toml(Config()))["chain"]["netuid"] == 38


@pytest.mark.parametrize("text,key", [
    ("[chain]\nnetuid = \"x\"\n", "netuid"),
    ("[api]\nport = 99999\n", "port"),
    ("[chain]\nnetwrk = \"x\"\n", "netwrk"),
])
def test_cli_exits_2_and_names_the_key(tmp_path, text, key):
    path = write(tmp_path / "bad.toml", text)
    result = run_dtrain("status", "--config", str(path), env={"HOME": str(tmp_path)})
    assert result.returncode == 2
    assert key in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
