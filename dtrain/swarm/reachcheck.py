"""``dtrain benchmark-bandwidth --check-reachability``: what can be tested, from this machine,
about whether validators and peers reach this node.

Each test says what it did and what it found; none of them can prove reachability from the
internet, and the report says so (``limits``). hivemind is imported only to dial the p2p
addresses, and only when there is a peer id to dial.
"""

from __future__ import annotations

import functools
import socket
import tempfile
import time
from typing import Any

from dtrain.swarm import reachability as ra

LIMITS = [
    "Every test runs from this machine. Connecting to your own public address goes through your router "
    "(hairpin NAT): it can succeed although the port is not forwarded from the internet, or fail on routers "
    "without hairpin support although the internet reaches you. Only an outside observer settles it: from "
    "another network (a VPS, a phone hotspot) run `curl http://HOST:PORT/v1/status` and "
    "`nc -vz HOST P2P_PORT`.",
    "A firewall that filters by source address (cloud security groups, ufw rules for one subnet) is invisible "
    "from here.",
    "DNS names are resolved by this machine's resolver; validators may resolve them differently.",
]


def _tcp_connect(host: str, port: int, timeout: float) -> tuple[bool, str, float | None]:
    """(connected, error, seconds): a plain TCP handshake, nothing sent."""
    started = time.monotonic()
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout):
            return True, "", round(time.monotonic() - started, 4)
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc}", None


def _listen_host(api_host: str) -> str:
    return "127.0.0.1" if api_host in ("0.0.0.0", "::", "") else api_host


def _api_section(address: str, source: str, api_host: str, api_port: int, timeout: float) -> dict[str, Any]:
    host, port = (None, None)
    try:
        host, port = ra.parse_host_port(address, what=source)
    except ra.AddressError as exc:
        return {"address": address, "source": source, "class": ra.INVALID, "error": str(exc)}
    listening, listen_error, _ = _tcp_connect(_listen_host(api_host), api_port, timeout)
    section: dict[str, Any] = {
        "address": address, "source": source, "class": ra.classify_host(host),
        "local_port": api_port, "listening": listening, "listen_error": listen_error or None,
    }
    connected, error, seconds = _tcp_connect(host, port, timeout)
    section.update(tcp_connect=connected, tcp_error=error or None, tcp_seconds=seconds)
    section.update(status_ok=None, status_error=None, peer_id=None, maddrs=[])
    if connected:
        from dtrain.api.client import MinerClient

        try:
            # The validators' hardened client: the same request, limits and parsing they apply.
            status = MinerClient(None, timeout=timeout).status(address)
        except Exception as exc:
            section.update(status_ok=False, status_error=f"{type(exc).__name__}: {exc}")
        else:
            section.update(status_ok=True, peer_id=status.peer_id, maddrs=list(status.maddrs or ()))
    return section


def _p2p_targets(announce_maddrs, host_maddrs, status_maddrs, peer_id: str | None) -> tuple[list[str], str]:
    """The p2p addresses to test and where they came from. What the running node itself
    reports (its /v1/status) is what hivemind really announces, so it comes first."""
    if status_maddrs:
        return list(status_maddrs), "the node's GET /v1/status (what hivemind announces)"
    expected = ra.expected_p2p(announce_maddrs, host_maddrs)
    if expected is None:
        return [], ("unknown before the node runs: allreduce.host_maddrs is a wildcard and announce_maddrs is "
                    "empty, so hivemind announces whatever the interfaces hold")
    maddrs, source = expected
    if peer_id:
        maddrs = [m if ra.parse_maddr(m).peer_id else f"{m.rstrip('/')}/p2p/{peer_id}" for m in maddrs]
    return maddrs, source


async def _dial_one(maddr: str, timeout: float, _dht, node) -> tuple[bool, str]:
    """In the probe's DHT process: connect to ``maddr`` and ping the DHT node behind it.

    p2pd's connect takes the transport address and the peer id apart: a multiaddr that still
    ends in /p2p/<id> is refused ("length greater than remaining number of bytes in buffer").
    """
    import asyncio

    from hivemind.p2p import PeerID

    from dtrain.swarm.hivemind_internals import dial

    parsed = ra.parse_maddr(maddr)
    peer = PeerID.from_base58(parsed.peer_id)
    transport = maddr[:maddr.rindex("/p2p/")] if not parsed.relayed else maddr
    try:
        await dial(node, parsed.peer_id, transport, timeout)
    except Exception as exc:
        return False, f"libp2p connection failed: {type(exc).__name__}: {exc}"
    try:
        answered = await asyncio.wait_for(node.protocol.call_ping(peer), timeout)
    except Exception as exc:
        return False, f"connected, but the DHT ping failed: {type(exc).__name__}: {exc}"
    return (True, "") if answered is not None else (False, "connected, but no answer to a DHT ping")


def _dial(maddrs: list[str], timeout: float) -> dict[str, tuple[bool, str]]:
    """Dial each full multiaddr (with /p2p/<id>) from a throwaway hivemind client and ping it."""
    from dtrain.swarm.node import SwarmNode, SwarmNodeConfig

    results: dict[str, tuple[bool, str]] = {}
    with tempfile.TemporaryDirectory(prefix="dtrain-reach-") as tmp:
        # client_mode: the probe serves nothing and is never added to anybody's routing table.
        # No UPnP either: the probe only dials out, and asking the router for a port is not its business.
        node = SwarmNode(SwarmNodeConfig(data_dir=tmp, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True,
                                         bootstrap_timeout_s=timeout, extra_dht_kwargs={"nat_port_map": False}))
        try:
            node.start()
            for maddr in maddrs:
                try:
                    # run_coroutine pickles the function into the DHT process: module-level only
                    results[maddr] = tuple(node.dht.run_coroutine(functools.partial(_dial_one, maddr, timeout)))
                except Exception as exc:
                    results[maddr] = (False, f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            for maddr in maddrs:
                results.setdefault(maddr, (False, f"probe node did not start: {exc}"))
        finally:
            node.shutdown()
    return results


def check_reachability(*, network: str, role: str, announce_maddrs=(), host_maddrs=("/ip4/0.0.0.0/tcp/0",),
                       external_address: str = "", api_host: str = "0.0.0.0", api_port: int = 8091,
                       peer_id: str | None = None, timeout: float = 3.0, dial_p2p: bool = True) -> dict[str, Any]:
    """One report (a JSON-able dict). ``peer_id``: this node's, when known from its status file
    (a validator has no status API to ask)."""
    findings = ra.preflight(network=network, role=role, announce_maddrs=list(announce_maddrs),
                            host_maddrs=list(host_maddrs), external_address=external_address, api_host=api_host,
                            api_port=api_port)
    doc: dict[str, Any] = {"network": network, "role": role, "requires_public": ra.requires_public(network),
                           "api": None, "p2p": None}
    status_maddrs: list[str] = []
    if role == "miner":
        address = ra.committed_api_address(external_address, api_host, api_port)
        source = "api.external_address" if external_address else "api.host/api.port (no external_address set)"
        doc["api"] = _api_section(address, source, api_host, api_port, timeout)
        status_maddrs = doc["api"].get("maddrs") or []
        peer_id = doc["api"].get("peer_id") or peer_id
    maddrs, source = _p2p_targets(announce_maddrs, host_maddrs, status_maddrs, peer_id)
    if status_maddrs:
        # Judge what hivemind really announces, not only what the config predicts.
        findings = [f for f in findings if f.what != "p2p"] + [ra.check_p2p(status_maddrs, network, source=source)]
    entries = [_p2p_entry(maddr, timeout) for maddr in maddrs]
    dialable = [e["maddr"] for e in entries if e["tcp_connect"] and ra.parse_maddr(e["maddr"]).peer_id]
    if dial_p2p and dialable:
        for maddr, (ok, error) in _dial(dialable, timeout).items():
            entry = next(e for e in entries if e["maddr"] == maddr)
            entry.update(dialed=ok, dial_error=error or None)
    doc["p2p"] = {"source": source, "peer_id": peer_id, "addresses": entries}
    doc["findings"] = [f.to_dict() for f in findings]
    problems = _problems(findings, doc["api"], entries, source=source, api_port=api_port)
    doc["warnings"] = [f.message for f in findings if f.level == ra.WARN]
    doc["problems"] = problems
    doc["ok"] = not problems
    doc["limits"] = LIMITS
    return doc


def _p2p_entry(maddr: str, timeout: float) -> dict[str, Any]:
    """One p2p address of the report, with a TCP handshake to it where that tests something."""
    entry: dict[str, Any] = {"maddr": maddr, "class": ra.classify_maddr(maddr), "tcp_connect": None,
                             "tcp_error": None, "tcp_seconds": None, "dialed": None, "dial_error": None}
    try:
        parsed = ra.parse_maddr(maddr)
    except ra.AddressError as exc:
        entry["tcp_error"] = str(exc)
        return entry
    if parsed.relayed:
        entry["tcp_error"] = "a relayed (p2p-circuit) address: the TCP port is the relay's, not tested"
    elif parsed.transport == "tcp" and parsed.port and entry["class"] != ra.UNSPECIFIED:
        ok, error, seconds = _tcp_connect(parsed.host, parsed.port, timeout)
        entry.update(tcp_connect=ok, tcp_error=error or None, tcp_seconds=seconds)
    return entry


def _problems(findings, api: dict[str, Any] | None, entries: list[dict[str, Any]], *, source: str,
              api_port: int) -> list[str]:
    """What stops validators and peers from reaching this node, each with the fix."""
    problems = [f.message for f in findings if f.level == ra.REFUSE]
    if api is not None:
        if api.get("error"):
            problems.append(api["error"])
        elif not api["listening"]:
            problems.append(f"nothing listens on the API port {api_port} here: start `dtrain mine`, then check again")
        elif not api["tcp_connect"]:
            problems.append(f"no TCP connection to {api['address']} ({api['tcp_error']}): check the port forward "
                            "and the firewall")
        elif not api["status_ok"]:
            problems.append(f"{api['address']} accepted a connection but GET /v1/status failed: {api['status_error']}")
    for e in entries:
        if e["tcp_connect"] is False:
            problems.append(f"no TCP connection to {e['maddr']} ({e['tcp_error']}): check the port forward, the "
                            "firewall and that the node runs")
        elif e["dialed"] is False:
            problems.append(f"{e['maddr']} accepts TCP but a hivemind peer could not reach the node there "
                            f"({e['dial_error']})")
    if not entries:
        problems.append(f"no p2p address to test: {source}")
    return problems
