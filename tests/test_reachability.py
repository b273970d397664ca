"""Reachability: the address classifier and its verdicts, the CLI flags and prompts, the refusal
before the chain is contacted, and the reachability check against a real loopback miner API
and hivemind DHT."""

from __future__ import annotations

import json
import time
import tomllib

import pytest

from dtrain.swarm import reachability as ra
from tests.conftest import drive_prompts, run_dtrain

PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


# --- parsing and classification ---------------------------------------------------------


@pytest.mark.parametrize("maddr, cls", [
    ("/ip4/127.0.0.1/tcp/31337", ra.LOOPBACK),
    ("/ip4/127.8.9.10/tcp/1", ra.LOOPBACK),
    ("/ip4/0.0.0.0/tcp/0", ra.UNSPECIFIED),
    ("/ip4/10.1.2.3/tcp/31337", ra.PRIVATE),
    ("/ip4/172.16.0.9/tcp/31337", ra.PRIVATE),
    ("/ip4/172.31.255.1/tcp/31337", ra.PRIVATE),
    ("/ip4/192.168.1.20/tcp/31337", ra.PRIVATE),
    ("/ip4/100.64.0.1/tcp/31337", ra.PRIVATE),  # CGNAT: the ISP's NAT, not yours
    ("/ip4/100.127.255.254/tcp/31337", ra.PRIVATE),
    ("/ip4/169.254.10.1/tcp/31337", ra.PRIVATE),  # link-local
    ("/ip4/172.32.0.1/tcp/31337", ra.PUBLIC),  # just outside 172.16/12
    ("/ip4/100.128.0.1/tcp/31337", ra.PUBLIC),  # just outside 100.64/10
    ("/ip4/8.8.8.8/tcp/31337", ra.PUBLIC),
    ("/ip4/203.0.113.7/tcp/31337", ra.RESERVED),  # documentation range: the docs' example, not an address
    ("/ip4/224.0.0.1/tcp/31337", ra.RESERVED),
    ("/ip6/::1/tcp/31337", ra.LOOPBACK),
    ("/ip6/::/tcp/0", ra.UNSPECIFIED),
    ("/ip6/fe80::1/tcp/31337", ra.PRIVATE),
    ("/ip6/fd12:3456::1/tcp/31337", ra.PRIVATE),  # ULA
    ("/ip6/2606:4700:4700::1111/tcp/31337", ra.PUBLIC),
    ("/ip6/2001:db8::7/tcp/31337", ra.RESERVED),
    ("/ip6/::ffff:127.0.0.1/tcp/31337", ra.LOOPBACK),  # IPv4-mapped
    ("/ip6/::ffff:192.168.0.1/tcp/31337", ra.PRIVATE),
    ("/dns4/miner.example.org/tcp/31337", ra.NAME),
    ("/dns6/miner.example.org/tcp/31337", ra.NAME),
    ("/dns/localhost/tcp/31337", ra.LOOPBACK),
    ("/ip4/127.0.0.1/tcp/31337/p2p/" + PEER, ra.LOOPBACK),
    ("/ip4/8.8.8.8/tcp/4001/p2p/" + PEER + "/p2p-circuit/p2p/" + PEER, ra.PUBLIC),  # via a public relay
    ("/ip4/1.2.3.4/udp/31337/quic-v1", ra.PUBLIC),
    ("not a multiaddr", ra.INVALID),
    ("/ip4/1.2.3/tcp/1", ra.INVALID),
])
def test_classify_maddr(maddr, cls):
    assert ra.classify_maddr(maddr) == cls


def test_parse_maddr_parts():
    m = ra.parse_maddr("/ip4/8.8.8.8/tcp/4001/p2p/" + PEER + "/p2p-circuit/p2p/QmTarget")
    assert (m.protocol, m.host, m.transport, m.port, m.peer_id, m.relayed) == \
        ("ip4", "8.8.8.8", "tcp", 4001, "QmTarget", True)
    m = ra.parse_maddr("/ip6/2606:4700::1111/tcp/31337")
    assert m.host_port == "[2606:4700::1111]:31337" and not m.relayed and m.peer_id is None


@pytest.mark.parametrize("text, fragment", [
    ("", "empty multiaddr"),
    ("ip4/1.2.3.4/tcp/1", "must start with '/'"),
    ("/ip4/1.2.3.4/tcpp/1", "unknown protocol 'tcpp'"),
    ("/ip4/1.2.3.400/tcp/1", "not an IPv4 address"),
    ("/ip6/zz::1/tcp/1", "not an IPv6 address"),
    ("/ip4/1.2.3.4", "names no /tcp/<port>"),
    ("/ip4/1.2.3.4/tcp/99999", "not a number in 0..65535"),
    ("/ip4/1.2.3.4/tcp", "needs a value"),
    ("/tcp/31337", "names no host"),
])
def test_parse_maddr_errors_name_the_address_and_show_an_example(text, fragment):
    with pytest.raises(ra.AddressError) as info:
        ra.parse_maddr(text)
    assert fragment in str(info.value)
    if text and fragment not in ("not an IPv6 address", "not a number in 0..65535"):
        assert ra.EXAMPLE_MADDR in str(info.value)


@pytest.mark.parametrize("text, expected", [
    ("8.8.8.8:8091", ("8.8.8.8", 8091)),
    ("miner.example.org:443", ("miner.example.org", 443)),
    ("[2606:4700::1111]:8091", ("2606:4700::1111", 8091)),
])
def test_parse_host_port(text, expected):
    assert ra.parse_host_port(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("8.8.8.8", "has no port"),
    (":8091", "has no host"),
    ("8.8.8.8:0", "not a number in 1..65535"),
    ("8.8.8.8:http", "not a number in 1..65535"),
    ("2606:4700::1111:8091", "in brackets"),
    ("[2606:4700::1111]8091", "must look like"),
    ("http://8.8.8.8:8091", "is a URL"),
    ("/ip4/8.8.8.8/tcp/8091", "looks like a multiaddr"),
])
def test_parse_host_port_errors(text, fragment):
    with pytest.raises(ra.AddressError) as info:
        ra.parse_host_port(text)
    assert fragment in str(info.value)


def test_announce_and_listen_validation():
    assert ra.validate_announce_maddr(" /ip4/8.8.8.8/tcp/31337 ") == "/ip4/8.8.8.8/tcp/31337"
    with pytest.raises(ra.AddressError, match="port 0"):
        ra.validate_announce_maddr("/ip4/8.8.8.8/tcp/0")  # hivemind refuses port 0 in announce_maddrs
    with pytest.raises(ra.AddressError, match="wildcard"):
        ra.validate_announce_maddr("/ip4/0.0.0.0/tcp/31337")
    assert ra.validate_host_maddr("/ip4/0.0.0.0/tcp/0") == "/ip4/0.0.0.0/tcp/0"
    with pytest.raises(ra.AddressError, match="/ip4 or /ip6"):
        ra.validate_host_maddr("/dns4/example.org/tcp/1")
    with pytest.raises(ra.AddressError, match="wildcard"):
        ra.validate_external_address("0.0.0.0:8091")


# --- verdicts -----------------------------------------------------------------------------


def test_loopback_only_p2p_is_refused_on_real_networks_only():
    for network in ("finney", "test", "ws://127.0.0.1:9944"):
        finding = ra.check_p2p(["/ip4/127.0.0.1/tcp/31337/p2p/" + PEER, "/ip6/::1/tcp/31337"], network)
        assert finding.level == ra.REFUSE
        assert "loopback" in finding.message and "--announce-maddr" in finding.message
    for network in ("sandbox", "local"):
        assert ra.check_p2p(["/ip4/127.0.0.1/tcp/1"], network).level == ra.OK
    assert ra.check_p2p([], "finney").level == ra.REFUSE  # nothing announced at all


def test_p2p_verdicts():
    # hivemind lists loopback beside the real interfaces: a public one makes the node reachable
    assert ra.check_p2p(["/ip4/127.0.0.1/tcp/1", "/ip4/8.8.8.8/tcp/1"], "finney").level == ra.OK
    assert ra.check_p2p(["/dns4/miner.example.org/tcp/1"], "finney").level == ra.OK
    relayed = f"/ip4/8.8.8.8/tcp/4001/p2p/{PEER}/p2p-circuit/p2p/{PEER}"
    assert ra.check_p2p([relayed], "finney").level == ra.OK
    warn = ra.check_p2p(["/ip4/127.0.0.1/tcp/1", "/ip4/192.168.1.5/tcp/1", "/ip4/100.64.1.1/tcp/1"], "finney")
    assert warn.level == ra.WARN and "192.168.1.5" in warn.message and "127.0.0.1" not in warn.message
    assert ra.check_p2p(["/ip6/fd00::5/tcp/1"], "test").level == ra.WARN
    wildcard = ra.check_p2p(["/ip4/0.0.0.0/tcp/31337"], "finney")
    assert wildcard.level == ra.REFUSE and "wildcard" in wildcard.message


def test_transports_p2pd_announces_beside_tcp_do_not_refuse_an_observed_public_address():
    quic = "/ip4/1.2.3.4/udp/4001/quic-v1/webtransport/certhash/uEiAkH5a4DPGKUuOBjYw0CgwjvcJCJMD2K_1mAT0yq9sB9g"
    assert ra.classify_maddr(quic) == ra.PUBLIC  # certhash takes a value
    unknown = "/unix/tmp/p2pd.sock"
    observed = ["/ip4/8.8.8.8/tcp/31337/p2p/" + PEER, quic, unknown]
    assert ra.check_p2p(observed, "finney", observed=True).level == ra.OK
    # typed by an operator, an address that does not parse is still refused
    assert ra.check_p2p(observed, "finney").level == ra.REFUSE
    # observed, but nothing usable at all: refused
    assert ra.check_p2p([unknown], "finney", observed=True).level == ra.REFUSE


def test_api_verdicts():
    refused = ra.check_api("127.0.0.1:8091", "finney")
    assert refused.level == ra.REFUSE and "127.0.0.1:8091" in refused.message and "--external-address" in refused.message
    assert ra.check_api("localhost:8091", "test").level == ra.REFUSE
    assert ra.check_api("[::1]:8091", "test").level == ra.REFUSE
    assert ra.check_api("0.0.0.0:8091", "test").level == ra.REFUSE
    assert ra.check_api("10.0.0.2:8091", "finney").level == ra.WARN
    assert ra.check_api("8.8.8.8:8091", "finney").level == ra.OK
    assert ra.check_api("miner.example.org:8091", "finney").level == ra.OK
    assert ra.check_api("127.0.0.1:8091", "sandbox").level == ra.OK
    assert ra.check_api("nonsense", "finney").level == ra.REFUSE


def test_committed_api_address_follows_the_miner_rule():
    assert ra.committed_api_address("", "0.0.0.0", 8091) == "127.0.0.1:8091"
    assert ra.committed_api_address("", "10.0.0.2", 8091) == "10.0.0.2:8091"
    assert ra.committed_api_address("", "2606:4700::1", 8091) == "[2606:4700::1]:8091"
    assert ra.committed_api_address("8.8.8.8:1", "0.0.0.0", 8091) == "8.8.8.8:1"


def test_preflight_defers_wildcard_listen_addresses_to_after_start():
    # 0.0.0.0: what p2pd announces is known only once it runs, so the config alone refuses nothing
    findings = ra.preflight(network="finney", role="validator", announce_maddrs=[],
                            host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    assert findings == []
    findings = ra.preflight(network="finney", role="validator", announce_maddrs=[],
                            host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    assert [f.level for f in findings] == [ra.REFUSE]
    findings = ra.preflight(network="finney", role="miner", announce_maddrs=["/ip4/8.8.8.8/tcp/31337"],
                            host_maddrs=["/ip4/0.0.0.0/tcp/0"], external_address="")
    assert [(f.what, f.level) for f in findings] == [("p2p", ra.OK), ("api", ra.REFUSE)]


def test_fixed_port_follows_the_announced_port():
    assert ra.fixed_port_host_maddrs(["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"], ["/ip4/8.8.8.8/tcp/4000"]) == \
        ["/ip4/0.0.0.0/tcp/4000", "/ip6/::/tcp/4000"]
    assert ra.fixed_port_host_maddrs(["/ip4/0.0.0.0/tcp/5000"], ["/ip4/8.8.8.8/tcp/4000"]) is None  # port forward
    assert ra.fixed_port_host_maddrs(["/ip4/0.0.0.0/tcp/0"], ["/ip4/8.8.8.8/tcp/1", "/ip4/8.8.4.4/tcp/2"]) is None


def test_swarm_node_config_listens_on_the_announced_port(tmp_path):
    from dtrain.config import Config
    from dtrain.neurons.runtime import swarm_node_config

    cfg = Config()
    cfg.allreduce.announce_maddrs = ["/ip4/8.8.8.8/tcp/4000"]
    node = swarm_node_config(cfg, tmp_path, [])
    assert node.host_maddrs == ["/ip4/0.0.0.0/tcp/4000"] and node.announce_maddrs == ["/ip4/8.8.8.8/tcp/4000"]
    cfg.allreduce.announce_maddrs = []
    assert swarm_node_config(cfg, tmp_path, []).host_maddrs == ["/ip4/0.0.0.0/tcp/0"]


# --- CLI: refusal before the chain ----------------------------------------------------------


@pytest.mark.parametrize("command, args, fragment", [
    ("mine", ["--network", "finney"], "127.0.0.1:8091"),  # the default config: no external address
    ("mine", ["--network", "ws://127.0.0.1:9", "--external-address", "8.8.8.8:8091",
              "--announce-maddr", "/ip4/127.0.0.1/tcp/31337"], "/ip4/127.0.0.1/tcp/31337"),
    ("mine", ["--network", "test", "--external-address", "localhost:8091"], "localhost:8091"),
    ("validate", ["--network", "finney", "--host-maddr", "/ip4/127.0.0.1/tcp/0"], "/ip4/127.0.0.1/tcp/0"),
])
def test_neurons_refuse_loopback_before_touching_the_chain(clean_env, command, args, fragment):
    started = time.monotonic()
    result = run_dtrain(command, *args, "--no-dashboard", "--wallet", "nowallet")
    assert result.returncode == 1, result.stderr
    assert "refusing to start" in result.stderr and fragment in result.stderr and "loopback" in result.stderr
    assert "--external-address" in result.stderr or "--announce-maddr" in result.stderr
    # Neither the wallet (missing here) nor the chain was reached: the config alone decided.
    assert "hotkey" not in result.stderr and "chain" not in result.stderr.replace("on chain", "")
    assert time.monotonic() - started < 60


def test_env_lists_and_bad_flags_are_named(clean_env):
    result = run_dtrain("validate", "--network", "test", "--no-dashboard",
                        env={"DTRAIN_ALLREDUCE_ANNOUNCE_MADDRS": "/ip4/127.0.0.1/tcp/1, /ip6/::1/tcp/1"})
    assert result.returncode == 1 and "/ip4/127.0.0.1/tcp/1, /ip6/::1/tcp/1" in result.stderr
    result = run_dtrain("mine", "--network", "test", "--announce-maddr", "/ip4/8.8.8.8/tcpp/1")
    assert result.returncode == 2
    assert "flag --announce-maddr" in result.stderr and "tcpp" in result.stderr and ra.EXAMPLE_MADDR in result.stderr
    result = run_dtrain("mine", "--network", "test", "--external-address", "8.8.8.8")
    assert result.returncode == 2 and "flag --external-address" in result.stderr and "no port" in result.stderr
    result = run_dtrain("validate", "--network", "test", env={"DTRAIN_ALLREDUCE_HOST_MADDRS": "/ip4/1.2.3/tcp/0"})
    assert result.returncode == 2 and "allreduce.host_maddrs" in result.stderr


def test_mine_and_validate_take_the_address_flags():
    import inspect

    from dtrain.cli.mine import mine
    from dtrain.cli.node_options import NodeOptions
    from dtrain.cli.validate import validate

    for command in (mine, validate):
        params = inspect.signature(command).parameters
        assert "announce_maddr" in params and "host_maddr" in params
    assert "external_address" in inspect.signature(mine).parameters
    overrides = NodeOptions(announce_maddr=["/ip4/8.8.8.8/tcp/1"], host_maddr=["/ip4/0.0.0.0/tcp/1"]).overrides()
    assert overrides["allreduce.announce_maddrs"] == ["/ip4/8.8.8.8/tcp/1"]
    assert overrides["allreduce.host_maddrs"] == ["/ip4/0.0.0.0/tcp/1"]
    assert NodeOptions().overrides()["allreduce.announce_maddrs"] is None


# --- CLI: init --------------------------------------------------------------------------------


def test_init_flags_write_the_addresses_and_pin_the_port(clean_env):
    path = clean_env / "m.toml"
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--network", "finney",
                        "--external-address", "8.8.8.8:8091", "--announce-maddr", "/ip4/8.8.8.8/tcp/4000",
                        "--announce-maddr", "/dns4/miner.example.org/tcp/4000")
    assert result.returncode == 0, result.stderr
    doc = tomllib.loads(path.read_text())
    assert doc["api"]["external_address"] == "8.8.8.8:8091"
    assert doc["allreduce"]["announce_maddrs"] == ["/ip4/8.8.8.8/tcp/4000", "/dns4/miner.example.org/tcp/4000"]
    assert doc["allreduce"]["host_maddrs"] == ["/ip4/0.0.0.0/tcp/4000"]  # the announced port, not tcp/0
    assert "note:" not in result.stderr

    path = clean_env / "v.toml"
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--role", "validator", "--network", "test",
                        "--announce-maddr", "/ip4/8.8.8.8/tcp/4000", "--host-maddr", "/ip4/0.0.0.0/tcp/5000")
    assert result.returncode == 0, result.stderr
    doc = tomllib.loads(path.read_text())
    assert doc["allreduce"]["host_maddrs"] == ["/ip4/0.0.0.0/tcp/5000"]  # an explicit listen port is kept


def test_init_rejects_bad_and_loopback_addresses(clean_env):
    path = clean_env / "c.toml"
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--announce-maddr", "/ip4/8.8.8.8/tcp")
    assert result.returncode == 2 and "flag --announce-maddr" in result.stderr and ra.EXAMPLE_MADDR in result.stderr
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--network", "test",
                        "--external-address", "127.0.0.1:8091")
    assert result.returncode == 2 and "api.external_address" in result.stderr and "loopback" in result.stderr
    assert not path.exists()
    # the sandbox runs on loopback by design
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--network", "sandbox",
                        "--external-address", "127.0.0.1:8091")
    assert result.returncode == 0, result.stderr


def test_init_without_addresses_says_what_mine_will_need(clean_env):
    path = clean_env / "c.toml"
    result = run_dtrain("init", "--no-prompt", "--config", str(path), "--network", "finney")
    assert result.returncode == 0 and path.exists()
    assert "note:" in result.stderr and "--external-address" in result.stderr and "refuses to start" in result.stderr


def test_init_prompts_for_addresses_and_suggests_them(clean_env):
    path = clean_env / "c.toml"
    # role, network, netuid, wallet, hotkey, store, API port, public host, API address (take the
    # suggestion), announce multiaddrs: first a typo (asked again), then the suggestion
    code, transcript = drive_prompts(["init", "--config", str(path)],
                              ["miner", "finney", "38", "w", "h", "", "8091", "8.8.8.8", "", "/ip4/8.8.8.8/tcpp/1", ""])
    assert code == 0, transcript
    assert "unknown protocol 'tcpp'" in transcript
    doc = tomllib.loads(path.read_text())
    assert doc["api"]["external_address"] == "8.8.8.8:8091"
    assert doc["allreduce"]["announce_maddrs"] == [f"/ip4/8.8.8.8/tcp/{ra.DEFAULT_P2P_PORT}"]
    assert doc["allreduce"]["host_maddrs"] == [f"/ip4/0.0.0.0/tcp/{ra.DEFAULT_P2P_PORT}"]


def test_init_prompt_refuses_a_loopback_api_address(clean_env):
    path = clean_env / "c.toml"
    code, transcript = drive_prompts(["init", "--config", str(path)],
                              ["miner", "test", "38", "w", "h", "", "8091", "", "127.0.0.1:8091", ""])
    assert code == 2, transcript
    assert "loopback" in transcript and not path.exists()


# --- the reachability check, against a real loopback miner API and hivemind DHT ---------------


@pytest.fixture(scope="module")
def loopback_miner(tmp_path_factory):
    """A hivemind DHT on loopback and a miner API whose /v1/status reports its multiaddrs."""
    pytest.importorskip("hivemind")
    pytest.importorskip("bittensor")
    from dtrain.api.messages import QueryLimits, StatusResponse
    from dtrain.api.server import Handlers, MinerApiServer
    from dtrain.swarm.node import SwarmNode, SwarmNodeConfig

    node = SwarmNode(SwarmNodeConfig(data_dir=str(tmp_path_factory.mktemp("node")),
                                     host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                     extra_dht_kwargs={"nat_port_map": False})).start()
    maddrs = tuple(node.visible_maddrs())

    def refuse(*_):
        raise AssertionError("the reachability check only reads the public status")

    server = MinerApiServer(
        Handlers(status=lambda: StatusResponse(epoch=0, peer_id=node.peer_id, maddrs=maddrs), train=refuse,
                 allreduce=refuse, state_slice=refuse),
        self_hotkey="5F3sa2TJAWMqDhXG6jhV4N8ko9SxwGy8TpaNS1repo5EYjQX", is_allowed=lambda hotkey: False,
        host="127.0.0.1", port=0, limits=QueryLimits(max_pages=1),
    ).start()
    yield node, server, maddrs
    server.stop()
    node.shutdown()


def test_check_reaches_a_loopback_miner(loopback_miner):
    from dtrain.swarm.reachcheck import check_reachability

    node, server, maddrs = loopback_miner
    report = check_reachability(network="local", role="miner", api_host="127.0.0.1", api_port=server.port,
                                external_address=f"127.0.0.1:{server.port}")
    assert report["ok"], report["problems"]
    api = report["api"]
    assert api["class"] == ra.LOOPBACK and api["listening"] and api["tcp_connect"] and api["status_ok"]
    assert api["peer_id"] == node.peer_id
    entries = report["p2p"]["addresses"]
    assert [e["maddr"] for e in entries] == list(maddrs) and "GET /v1/status" in report["p2p"]["source"]
    assert all(e["class"] == ra.LOOPBACK and e["tcp_connect"] and e["dialed"] for e in entries), entries
    assert report["limits"] and "hairpin" in report["limits"][0]


def test_check_reports_loopback_as_a_problem_on_a_real_network(loopback_miner):
    from dtrain.swarm.reachcheck import check_reachability

    _, server, _ = loopback_miner
    report = check_reachability(network="test", role="miner", api_host="127.0.0.1", api_port=server.port,
                                dial_p2p=False)
    assert not report["ok"]
    assert report["api"]["address"] == f"127.0.0.1:{server.port}" and report["api"]["status_ok"]
    levels = {f["what"]: f["level"] for f in report["findings"]}
    assert levels == {"api": ra.REFUSE, "p2p": ra.REFUSE}  # judged on what the node really announces
    assert all(e["dialed"] is None for e in report["p2p"]["addresses"])  # not tested, and said so


def test_check_reachability_cli_json(clean_env, loopback_miner):
    node, server, _ = loopback_miner
    result = run_dtrain("benchmark-bandwidth", "--check-reachability", "--network", "local", "--json",
                        "--external-address", f"127.0.0.1:{server.port}",
                        env={"DTRAIN_API_PORT": str(server.port), "DTRAIN_API_HOST": "127.0.0.1"})
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)  # one JSON document and nothing else on stdout
    assert doc["ok"] and doc["api"]["status_ok"] and doc["p2p"]["peer_id"] == node.peer_id
    assert all(e["dialed"] for e in doc["p2p"]["addresses"])


def test_check_reachability_cli_text_when_nothing_runs(clean_env):
    result = run_dtrain("benchmark-bandwidth", "--check-reachability", "--network", "finney",
                        "--announce-maddr", "/ip4/127.0.0.1/tcp/9", env={"DTRAIN_API_PORT": "9"})
    assert result.returncode == 1
    out = result.stdout
    assert "(loopback" in out and "something listens on local port 9: NO" in out
    assert "/ip4/127.0.0.1/tcp/9 (loopback)" in out and "hairpin" in out and "verdict: NOT reachable" in out


# --- the neuron's own check, after hivemind has started -------------------------------------


class _FakeNode:
    def __init__(self, maddrs):
        self.maddrs, self.stopped = maddrs, False

    def visible_maddrs(self):
        return list(self.maddrs)

    def shutdown(self):
        self.stopped = True


def _neuron(network: str, maddrs):
    import threading

    from dtrain.config import Config
    from dtrain.neurons.base import NeuronBase
    from dtrain.telemetry import Telemetry

    cfg = Config()
    cfg.chain.network = network
    neuron = NeuronBase(cfg, Telemetry("miner"), threading.Event())
    neuron.node = _FakeNode(maddrs)
    return neuron


def test_neuron_refuses_what_hivemind_really_announces():
    """0.0.0.0 is judged once p2pd has listed its interfaces: here only loopback."""
    from dtrain.neurons.runtime import NeuronError

    neuron = _neuron("finney", [f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER}"])
    with pytest.raises(NeuronError, match="only loopback") as info:
        neuron._check_announced()
    assert "interfaces of allreduce.host_maddrs" in str(info.value) and neuron.node.stopped


def test_neuron_warns_once_on_private_and_is_quiet_on_public_or_sandbox():
    neuron = _neuron("finney", [f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER}", f"/ip4/192.168.1.9/tcp/4000/p2p/{PEER}"])
    neuron._check_announced()
    events = neuron.tel.snapshot().events
    assert len(events) == 1 and "warning" in events[0] and "192.168.1.9" in events[0] and not neuron.node.stopped
    for network, maddr in (("finney", "/ip4/8.8.8.8/tcp/4000"), ("sandbox", "/ip4/127.0.0.1/tcp/4000")):
        neuron = _neuron(network, [maddr])
        neuron._check_announced()
        assert neuron.tel.snapshot().events == [] and not neuron.node.stopped


def test_api_port_zero_is_judged_by_its_host():
    # port 0: picked when the server binds; the sandbox uses it, and a loopback host is still refused elsewhere
    assert ra.preflight(network="sandbox", role="miner", announce_maddrs=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                        api_host="127.0.0.1", api_port=0)[-1].level == ra.OK
    finding = ra.preflight(network="test", role="miner", announce_maddrs=[], host_maddrs=["/ip4/0.0.0.0/tcp/0"],
                           api_port=0)[-1]
    assert finding.level == ra.REFUSE and "127.0.0.1:<port picked at start>" in finding.message
    assert ra.preflight(network="test", role="miner", announce_maddrs=[], host_maddrs=["/ip4/0.0.0.0/tcp/0"],
                        api_host="8.8.8.8", api_port=0)[-1].level == ra.OK
