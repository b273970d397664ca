"""`dtrain status` against hostile miners and corrupt local files: it reports what it
can, never crashes, never hangs on one miner, and only ever prints strict JSON."""

from __future__ import annotations

import http.server
import json
import math
import socket
import threading
import time

import pytest

from dtrain.chain import sandbox
from dtrain.chain.commitment import MinerCommitment
from dtrain.chain.sandbox import SandboxChain
from dtrain.cli.common import print_json
from dtrain.cli.status import poll_loop, poll_once
from dtrain.config import Config
from dtrain.status import collect_status
from tests.conftest import run_dtrain

PEER = "12D3KooWabcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTU"


def _strict_loads(text: str):
    def refuse(name: str):
        raise ValueError(f"non-JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _all_finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_all_finite(v) for v in value)
    return True


class _StatusServer:
    """A miner's public API reduced to GET /v1/status answering fixed raw bytes."""

    def __init__(self, body: bytes):
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

        self.body = body
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.api = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


class _Trickler:
    """A miner that answers its status one byte every 0.5 s: must not hang the report."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.api = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.recv(4096)
                    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b" " * 100:
                        if self.stop.is_set():
                            break
                        conn.sendall(bytes([byte]))
                        time.sleep(0.5)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


HOSTILE = {
    "good": b'{"epoch": 4, "loss": 2.5, "samples": 8, "samples_accumulated": 100}',
    # Right epoch, garbage counters: counted as 0 toward the global samples.
    "same-epoch-garbage": b'{"epoch": 4, "loss": "low", "samples": -1, "samples_accumulated": "lots"}',
    "brief": b'{"epoch": "x", "samples_accumulated": "lots", "loss": 1e999}',  # 1e999 parses as inf
    "negative": b'{"epoch": -3, "loss": -1e400, "samples": 1.5, "samples_accumulated": -7}',
    "wrong-types": b'{"epoch": true, "loss": [1], "samples": {"a": 1}, "samples_accumulated": null}',
    "float-epoch": b'{"epoch": 4.0, "loss": 1e308, "samples": true}',
    "huge-int-loss": b'{"epoch": 1, "loss": ' + b"9" * 400 + b"}",
    "nan-literal": b'{"epoch": 4, "loss": NaN, "samples_accumulated": 1000000}',  # rejected whole
    "not-an-object": b"[4, 2.5]",
    "not-json": b"\xff\xfeepoch",
    "deep": b"[" * 100_000,
}


@pytest.fixture
def hostile_subnet(tmp_path):
    """A sandbox chain whose miners' APIs are the servers above, plus one that trickles
    and one that is down. Yields (cfg, {name: uid})."""
    chain_dir = tmp_path / "chain"
    sandbox.create(chain_dir)
    servers: list = []
    uids: dict[str, int] = {}
    with SandboxChain(chain_dir) as admin:
        admin.register("validator-hk", stake=100.0, validator_permit=True)
    plan = {name: _StatusServer(body) for name, body in HOSTILE.items()}
    plan["trickle"] = _Trickler()
    servers += plan.values()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
        apis = {name: server.api for name, server in plan.items()}
        apis["down"] = f"127.0.0.1:{closed.getsockname()[1]}"
    for name, api in apis.items():
        hotkey = f"miner-{name}"
        with SandboxChain(chain_dir) as admin:
            uids[name] = admin.register(hotkey)
        with SandboxChain(chain_dir, hotkey=hotkey) as chain:
            assert chain.commit(MinerCommitment(peer_id=PEER, api=api, repo="x"))
    cfg = Config()
    cfg.chain.network = "sandbox"
    cfg.chain.sandbox_dir = str(chain_dir)
    cfg.node.data_dir = str(tmp_path / "data")
    (tmp_path / "data").mkdir()
    try:
        yield cfg, uids
    finally:
        for server in servers:
            server.close()


def test_hostile_miners_cannot_crash_or_hang_status(hostile_subnet):
    cfg, uids = hostile_subnet
    started = time.monotonic()
    doc = collect_status(cfg, probe_timeout=5.0)
    # Probes run in parallel, each bounded in total. Unbounded, the trickler alone would take
    # 70 s; the guard is far above the ~5 s bound so a loaded machine cannot trip it.
    assert time.monotonic() - started < 45
    assert doc["chain_error"] is None
    json.dumps(doc, allow_nan=False)  # strict JSON as collected
    miners = {m["uid"]: m for m in doc["miners"]}
    by_name = {name: miners[uid] for name, uid in uids.items()}

    good = by_name["good"]
    assert (good["epoch"], good["loss"], good["samples"], good["alive"]) == (4, 2.5, 8, True)
    for name in ("brief", "negative", "wrong-types"):
        m = by_name[name]
        assert m["alive"] and m["epoch"] is None and m["loss"] is None and m["samples"] is None, (name, m)
    assert by_name["same-epoch-garbage"]["epoch"] == 4 and by_name["same-epoch-garbage"]["loss"] is None
    assert by_name["float-epoch"]["epoch"] is None and by_name["float-epoch"]["loss"] == 1e308
    assert by_name["float-epoch"]["samples"] is None
    assert by_name["huge-int-loss"]["epoch"] == 1 and by_name["huge-int-loss"]["loss"] is None
    for name in ("nan-literal", "not-an-object", "not-json", "deep", "trickle", "down"):
        assert by_name[name]["alive"] is False and by_name[name]["epoch"] is None, name
    # Global progress: the highest sane epoch; garbage counters add 0, and the NaN
    # miner's 1000000 never got in because its whole answer was refused.
    assert doc["global"]["epoch"] == 4
    assert doc["global"]["samples"] == 100


def test_non_finite_values_anywhere_become_null(hostile_subnet, tmp_path):
    cfg, uids = hostile_subnet
    data = tmp_path / "data"
    # Local files are written by our own neurons, but Python's json writes NaN happily
    # and a half-written or hand-edited file is possible: none of it may leak through.
    (data / "miner-down").mkdir()
    (data / "miner-down" / "status.json").write_text(json.dumps({
        "role": "miner", "hotkey": "miner-down", "epoch": 2, "loss": float("nan"),
        "samples": 3, "started_at": float("inf"), "extra": [1.0, float("-inf"), {"x": float("nan")}],
    }))
    (data / "validator-x").mkdir()
    (data / "validator-x" / "state.json").write_text(json.dumps({
        "version": 1, "ema": {str(uids["good"]): 0.5, str(uids["brief"]): 0.25},
        "recent_rounds": [{"round": 1, "fraction_averaged": float("inf"), "loss_after": float("nan"),
                           "miners": [{"uid": 1, "outcome": "ok"}, "junk"]}, "junk"],
    }))
    doc = collect_status(cfg, probe_timeout=5.0)
    assert _all_finite(doc)
    json.dumps(doc, allow_nan=False)
    assert doc["local"]["loss"] is None and doc["local"]["extra"] == [1.0, None, {"x": None}]
    miners = {m["uid"]: m for m in doc["miners"]}
    # The offline miner shows its last snapshot, minus the NaN.
    down = miners[uids["down"]]
    assert (down["alive"], down["epoch"], down["loss"], down["samples"]) == (False, 2, None, 3)
    assert miners[uids["good"]]["score"] == 0.5 and miners[uids["brief"]]["score"] == 0.25
    assert doc["rounds"][0]["fraction_averaged"] is None and doc["rounds"][0]["loss_after"] is None
    assert doc["rounds"][0]["peers"] == [{"peer_id": "uid 1", "outcome": "ok"}]
    # Byte counts the summary does not hold are unknown, not a made-up 0.
    assert doc["rounds"][0]["bytes_sent"] is None and doc["rounds"][0]["bytes_received"] is None


def test_an_unusable_validator_state_is_named_not_half_read(hostile_subnet, tmp_path):
    """status reads the validator's state exactly as the validator would (load_state)."""
    cfg, uids = hostile_subnet
    path = tmp_path / "data" / "validator-x" / "state.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"version": 1, "ema": {str(uids["good"]): float("nan")}}))
    doc = collect_status(cfg, probe_timeout=5.0)
    assert str(path) in doc["validator_state_error"] and "non-finite" in doc["validator_state_error"]
    assert all(m["score"] is None for m in doc["miners"]) and doc["rounds"] == []
    assert doc["chain_error"] is None and len(doc["miners"]) == len(uids)  # the rest is still reported


def test_status_without_chain_is_still_finite(tmp_path):
    data = tmp_path / "data"
    (data / "node").mkdir(parents=True)
    (data / "node" / "status.json").write_text(json.dumps({"role": "miner", "loss": float("nan")}))
    cfg = Config()
    cfg.chain.network = "sandbox"
    cfg.chain.sandbox_dir = str(tmp_path / "missing")
    cfg.node.data_dir = str(data)
    doc = collect_status(cfg)
    assert doc["chain_error"] and doc["local"]["loss"] is None
    json.dumps(doc, allow_nan=False)


def test_status_json_cli_prints_strict_json(hostile_subnet, clean_env):
    cfg, uids = hostile_subnet
    result = run_dtrain("status", "--json", "--network", "sandbox", "--sandbox-dir", cfg.chain.sandbox_dir,
                        timeout=120)
    assert result.returncode == 0, result.stderr
    doc = _strict_loads(result.stdout)
    assert doc["global"]["epoch"] == 4 and len(doc["miners"]) == len(uids)


# -- --watch's poll thread ------------------------------------------------------------------------------


class _Flaky:
    """collect_status's stand-in for the poll thread: a scripted series of answers and
    failures (what collect_status returns is tested above; here the thread is under test).
    With ``latest``, each call first records the doc the previous poll left on screen."""

    def __init__(self, script, latest=None):
        self.script = list(script)
        self.latest = latest
        self.seen: list[dict] = []
        self.calls = 0

    def __call__(self, cfg):
        self.calls += 1
        if self.latest is not None:
            self.seen.append(self.latest["doc"])
        step = self.script.pop(0) if self.script else {"n": 99}
        if isinstance(step, BaseException):
            raise step
        return step


def test_poll_once_keeps_last_good_doc_and_records_error():
    last = {"n": 1, "miners": [1]}
    doc = poll_once(None, last, _Flaky([RuntimeError("chain exploded")]))
    assert doc["n"] == 1 and doc["miners"] == [1] and "chain exploded" in doc["poll_error"]
    assert "poll_error" not in last  # the good doc itself is not mutated
    assert poll_once(None, doc, _Flaky([{"n": 2}])) == {"n": 2}  # success clears the error


def test_poll_thread_survives_errors():
    latest = {"doc": {"n": 1}}
    collect = _Flaky([RuntimeError("boom"), ValueError("bad miner"), {"n": 2}, KeyError("k"), {"n": 3}], latest)
    stop = threading.Event()
    thread = threading.Thread(target=poll_loop, args=(None, latest, stop, 0.05, collect), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while collect.calls < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.is_alive() and collect.calls >= 7
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    # What the screen showed after each poll: stale data kept with the error, until
    # the next success replaces it.
    shown = [(d["n"], d.get("poll_error")) for d in collect.seen[:6]]
    assert shown == [(1, None), (1, "RuntimeError: boom"), (1, "ValueError: bad miner"), (2, None),
                     (2, "KeyError: 'k'"), (3, None)]


# -- print_json ---------------------------------------------------------------------------------------


def test_print_json_is_strict(capsys):
    print_json({"a": float("nan"), "b": [1.5, float("inf"), (float("-inf"), {"c": float("nan")})],
                "d": {"e": 2, "f": "NaN"}, "g": None})
    out = capsys.readouterr().out
    assert _strict_loads(out) == {"a": None, "b": [1.5, None, [None, {"c": None}]],
                                  "d": {"e": 2, "f": "NaN"}, "g": None}
