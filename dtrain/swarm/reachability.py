"""Can other machines reach this node? Parse and classify the addresses a node announces (its
p2p multiaddrs, a miner's committed API address), and decide whether starting with them is fine,
worth a warning, or must be refused.

Pure: no sockets, no DNS, no hivemind, so the CLI and the neurons judge an address the same way
wherever it is typed or announced. The rules (loopback refused on networks of other machines,
private addresses warned about, sandbox and local never checked): docs/operators.md,
"Reachability and NAT".
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

EXAMPLE_MADDR = "/ip4/203.0.113.7/tcp/31337"
EXAMPLE_API = "203.0.113.7:8091"
DEFAULT_P2P_PORT = 31337  # the fixed port suggested when an announce address is given

# Address classes, from least to most reachable.
INVALID = "invalid"
UNSPECIFIED = "unspecified"  # 0.0.0.0 / :: - a listen wildcard, never an address to dial
LOOPBACK = "loopback"
PRIVATE = "private"  # RFC 1918, CGNAT 100.64/10, link-local, IPv6 ULA
RESERVED = "reserved"  # documentation, benchmarking, multicast, 240/4: not routable on the internet
NAME = "name"  # a DNS name: not resolved here (no network calls), presumed public
PUBLIC = "public"

OK, WARN, REFUSE = "ok", "warn", "refuse"

_PORT_AT_START = "<port picked at start>"

# Networks whose peers may all live on this machine: loopback is right there.
LOOPBACK_NETWORKS = ("sandbox", "local")

# Multiaddr protocols dtrain understands, and whether each takes a value.
_WITH_VALUE = {"ip4", "ip6", "dns", "dns4", "dns6", "dnsaddr", "tcp", "udp", "p2p", "ipfs", "ip6zone", "sni",
               "certhash"}
_NO_VALUE = {"p2p-circuit", "quic", "quic-v1", "ws", "wss", "tls", "noise", "http", "https", "webtransport",
             "webrtc", "webrtc-direct"}
_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6", "dnsaddr")

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_ULA = ipaddress.ip_network("fc00::/7")


class AddressError(ValueError):
    """An address that does not parse; the message names it and shows a valid example."""


@dataclass(frozen=True)
class Maddr:
    """The parts of a multiaddr that decide whether it can be dialed."""

    text: str
    protocol: str  # ip4, ip6, dns, dns4, dns6 or dnsaddr
    host: str
    transport: str  # tcp or udp ("" when the address names none)
    port: int | None
    peer_id: str | None  # the last /p2p/<id> (the node itself, also for a relayed address)
    relayed: bool  # a /p2p-circuit address: dialed through the relay named before it

    @property
    def host_port(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_maddr(text: str) -> Maddr:
    """Parse a multiaddr such as ``/ip4/203.0.113.7/tcp/31337[/p2p/<peer id>]``."""
    if not isinstance(text, str) or not text.strip():
        raise AddressError(f"empty multiaddr; expected something like {EXAMPLE_MADDR}")
    text = text.strip()
    if not text.startswith("/"):
        raise AddressError(f"multiaddr {text!r} must start with '/'; expected something like {EXAMPLE_MADDR}")
    parts = text.rstrip("/").split("/")[1:]
    comps: list[tuple[str, str]] = []
    i = 0
    while i < len(parts):
        proto = parts[i]
        if proto in _WITH_VALUE:
            if i + 1 >= len(parts) or not parts[i + 1]:
                raise AddressError(f"multiaddr {text!r}: /{proto} needs a value; expected something like "
                                   f"{EXAMPLE_MADDR}")
            comps.append((proto, parts[i + 1]))
            i += 2
        elif proto in _NO_VALUE:
            comps.append((proto, ""))
            i += 1
        else:
            raise AddressError(f"multiaddr {text!r}: unknown protocol {proto!r}; expected something like "
                               f"{EXAMPLE_MADDR}")
    relayed = any(p == "p2p-circuit" for p, _ in comps)
    # For a relayed address the host/port are the relay's: that is what a dialer connects to.
    host_comp = next(((p, v) for p, v in comps if p in _HOST_PROTOCOLS), None)
    if host_comp is None:
        raise AddressError(f"multiaddr {text!r} names no host (/ip4, /ip6 or /dns); expected something like "
                           f"{EXAMPLE_MADDR}")
    protocol, host = host_comp
    if protocol == "ip4":
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise AddressError(f"multiaddr {text!r}: {host!r} is not an IPv4 address; expected something like "
                               f"{EXAMPLE_MADDR}") from None
    elif protocol == "ip6":
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(f"multiaddr {text!r}: {host!r} is not an IPv6 address; expected something like "
                               "/ip6/2001:db8::7/tcp/31337") from None
    start = comps.index(host_comp)
    transport, port = "", None
    for proto, value in comps[start + 1:]:
        if proto in ("tcp", "udp"):
            if not value.isdigit() or int(value) > 65535:
                raise AddressError(f"multiaddr {text!r}: port {value!r} is not a number in 0..65535")
            transport, port = proto, int(value)
            break
        if proto in _HOST_PROTOCOLS or proto == "p2p-circuit":
            break
    if protocol != "dnsaddr" and port is None:
        raise AddressError(f"multiaddr {text!r} names no /tcp/<port>; expected something like {EXAMPLE_MADDR}")
    peer_ids = [v for p, v in comps if p in ("p2p", "ipfs")]
    return Maddr(text=text, protocol=protocol, host=host, transport=transport, port=port,
                 peer_id=peer_ids[-1] if peer_ids else None, relayed=relayed)


def parse_host_port(text: str, *, what: str = "address") -> tuple[str, int]:
    """``host:port`` (IPv6 bracketed: ``[2001:db8::7]:8091``) → (host, port), with port in 1..65535."""
    if not isinstance(text, str) or not text.strip():
        raise AddressError(f"empty {what}; expected host:port such as {EXAMPLE_API}")
    text = text.strip()
    if "://" in text:
        raise AddressError(f"{what} {text!r} is a URL; give host:port only, such as {EXAMPLE_API}")
    if text.startswith("/"):
        raise AddressError(f"{what} {text!r} looks like a multiaddr; give host:port such as {EXAMPLE_API} "
                           "(multiaddrs go to --announce-maddr)")
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1:end + 2] != ":":
            raise AddressError(f"{what} {text!r}: an IPv6 host must look like [2001:db8::7]:8091")
        host, port_text = text[1:end], text[end + 2:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(f"{what} {text!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise AddressError(f"{what} {text!r} has no port; expected host:port such as {EXAMPLE_API}")
        if ":" in host:
            raise AddressError(f"{what} {text!r}: put an IPv6 host in brackets, such as [2001:db8::7]:8091")
        if not host:
            raise AddressError(f"{what} {text!r} has no host; expected host:port such as {EXAMPLE_API}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise AddressError(f"{what} {text!r}: port {port_text!r} is not a number in 1..65535")
    return host, int(port_text)


def classify_host(host: str) -> str:
    """The class of an IP address or DNS name (no lookup is made for names)."""
    host = host.strip().strip("[]")
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone (fe80::1%eth0)
    except ValueError:
        name = host.lower().rstrip(".")
        if not name:
            return INVALID
        if name == "localhost" or name.endswith(".localhost"):
            return LOOPBACK
        return NAME
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return UNSPECIFIED
    if ip.is_loopback:
        return LOOPBACK
    if ip.is_link_local or ip in _CGNAT or (ip.version == 6 and ip in _ULA):
        return PRIVATE
    if ip.version == 4 and any(ip in ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12",
                                                                       "192.168.0.0/16")):
        return PRIVATE
    if ip.is_global and not ip.is_multicast:  # Python counts some multicast ranges as global
        return PUBLIC
    return RESERVED  # documentation, benchmarking, multicast, 240/4: not routable on the internet


def classify_maddr(text: str) -> str:
    """Class of a multiaddr's host (for a relayed address: the relay's), INVALID if it does not parse."""
    try:
        return classify_host(parse_maddr(text).host)
    except AddressError:
        return INVALID


def requires_public(network: str) -> bool:
    """Whether peers on ``network`` are other machines, so loopback cannot do."""
    return network not in LOOPBACK_NETWORKS


@dataclass(frozen=True)
class Finding:
    """One verdict: ``level`` is ok, warn or refuse; ``message`` says why and what fixes it."""

    level: str
    what: str  # "p2p" or "api"
    addresses: tuple[str, ...]
    classes: tuple[str, ...]
    message: str

    def to_dict(self) -> dict:
        return {"level": self.level, "what": self.what, "addresses": list(self.addresses),
                "classes": list(self.classes), "message": self.message}


_P2P_FIX = (f"set allreduce.announce_maddrs (flag --announce-maddr, e.g. {EXAMPLE_MADDR}) to the public IP "
            "and a fixed TCP port forwarded to allreduce.host_maddrs (--host-maddr /ip4/0.0.0.0/tcp/31337)")
_API_FIX = (f"set api.external_address (flag --external-address, e.g. {EXAMPLE_API}) to the public host:port "
            "that reaches api.port")


def check_p2p(maddrs, network: str, *, source: str = "allreduce.announce_maddrs",
              observed: bool = False) -> Finding:
    """Judge the p2p multiaddrs a node would announce (``source`` names where they came from).

    ``observed``: the addresses are what p2pd found on its interfaces, not what an operator
    typed. p2pd may list transports dtrain does not parse; those are left out of the verdict
    (peers dial whichever address works), where a typed one that does not parse is refused.
    """
    maddrs = tuple(str(m) for m in maddrs)
    classes = tuple(classify_maddr(m) for m in maddrs)
    if not requires_public(network):
        return Finding(OK, "p2p", maddrs, classes, f"network {network!r} runs on this machine; loopback is fine")
    if observed and any(c != INVALID for c in classes):
        kept = [(m, c) for m, c in zip(maddrs, classes) if c != INVALID]
        maddrs, classes = tuple(m for m, _ in kept), tuple(c for _, c in kept)
    bad = [m for m, c in zip(maddrs, classes) if c in (INVALID, UNSPECIFIED)]
    if bad:
        return Finding(REFUSE, "p2p", maddrs, classes,
                       f"{source} holds {', '.join(bad)}, which peers cannot dial (0.0.0.0/:: is a listen "
                       f"wildcard, not an address; a multiaddr must parse). Fix: {_P2P_FIX}")
    usable = [(m, c) for m, c in zip(maddrs, classes) if c != LOOPBACK]
    if not usable:
        shown = ", ".join(maddrs) if maddrs else "no address at all"
        return Finding(REFUSE, "p2p", maddrs, classes,
                       f"on {network} this node would announce only loopback p2p addresses ({shown}, from {source}): "
                       "peers on other machines would dial themselves and never reach it, so it could not join "
                       f"all-reduce rounds. Fix: {_P2P_FIX}")
    if any(c in (PUBLIC, NAME) for _, c in usable):
        return Finding(OK, "p2p", maddrs, classes, "a public p2p address is announced")
    shown = ", ".join(m for m, _ in usable)
    return Finding(WARN, "p2p", maddrs, classes,
                   f"the p2p addresses announced on {network} are private or not routable ({shown}, from {source}): "
                   "only peers inside that network (LAN, VPN) can dial them. Behind NAT, forward a fixed TCP port "
                   f"and {_P2P_FIX}")


def committed_api_address(external_address: str, api_host: str, api_port: int) -> str:
    """The API address a miner commits on chain (the rule the miner applies after binding).

    A wildcard listen host is committed as 127.0.0.1: without an external address the miner
    knows no better, which is exactly what :func:`check_api` refuses on a real network.
    """
    if external_address:
        return external_address
    host = "127.0.0.1" if api_host in ("0.0.0.0", "::", "") else api_host
    host = f"[{host}]" if ":" in host else host
    # api.port 0: the port is picked when the server binds; the host alone decides the verdict.
    return f"{host}:{api_port or _PORT_AT_START}"


def check_api(address: str, network: str, *, source: str = "api.external_address") -> Finding:
    """Judge the host:port a miner commits on chain for validators to dial."""
    if not requires_public(network):
        return Finding(OK, "api", (address,), (classify_host(address.rpartition(":")[0]),),
                       f"network {network!r} runs on this machine; loopback is fine")
    try:
        host, _ = parse_host_port(address.replace(":" + _PORT_AT_START, ":1"), what=source)
        cls = classify_host(host)
    except AddressError as exc:
        return Finding(REFUSE, "api", (address,), (INVALID,), f"{exc}. Fix: {_API_FIX}")
    if cls in (LOOPBACK, UNSPECIFIED):
        return Finding(REFUSE, "api", (address,), (cls,),
                       f"on {network} the miner API would be committed on chain as {address} ({cls}, from {source}): "
                       "every validator would dial its own machine, never query this miner, and it would earn "
                       f"nothing. Fix: {_API_FIX}")
    if cls in (PRIVATE, RESERVED):
        return Finding(WARN, "api", (address,), (cls,),
                       f"the miner API committed on {network} is {address}, a {cls} address: validators outside "
                       f"that network cannot reach it. Fix: {_API_FIX}")
    return Finding(OK, "api", (address,), (cls,), "a public API address is committed")


def expected_p2p(announce_maddrs, host_maddrs) -> tuple[list[str], str] | None:
    """What hivemind will announce, when it is knowable before start: (addresses, source).

    None when a listen address is a wildcard (0.0.0.0, ::): p2pd then announces whatever
    its interfaces hold, known only once it runs (the neuron checks those after start).
    """
    if announce_maddrs:
        return list(announce_maddrs), "allreduce.announce_maddrs"
    classes = [classify_maddr(m) for m in host_maddrs]
    if not host_maddrs or UNSPECIFIED in classes:
        return None
    return list(host_maddrs), "allreduce.host_maddrs (no announce_maddrs set)"


def preflight(*, network: str, role: str, announce_maddrs, host_maddrs, external_address: str = "",
              api_host: str = "0.0.0.0", api_port: int = 8091) -> list[Finding]:
    """Every verdict that can be reached from the config alone, before the chain is contacted."""
    findings = []
    expected = expected_p2p(announce_maddrs, host_maddrs)
    if expected is not None:
        findings.append(check_p2p(expected[0], network, source=expected[1]))
    if role == "miner":
        source = "api.external_address" if external_address else "api.host/api.port (no external_address set)"
        findings.append(check_api(committed_api_address(external_address, api_host, api_port), network,
                                  source=source))
    return findings


def refusals(findings) -> list[Finding]:
    return [f for f in findings if f.level == REFUSE]


def warnings(findings) -> list[Finding]:
    return [f for f in findings if f.level == WARN]


def validate_announce_maddr(text: str) -> str:
    """An announce multiaddr as typed by an operator: it must parse, name a port other than 0
    (hivemind refuses port 0 there) and not be a wildcard. Returns it stripped."""
    m = parse_maddr(text)
    if m.port == 0:
        raise AddressError(f"announce multiaddr {m.text!r} has port 0; announce the fixed port peers should dial, "
                           f"such as {EXAMPLE_MADDR}")
    if classify_host(m.host) == UNSPECIFIED:
        raise AddressError(f"announce multiaddr {m.text!r} is a wildcard (0.0.0.0/::), which peers cannot dial; "
                           f"announce your public IP, such as {EXAMPLE_MADDR}")
    return m.text


def validate_host_maddr(text: str) -> str:
    """A listen multiaddr: an IP (names cannot be bound) and a port (0: any free port)."""
    m = parse_maddr(text)
    if m.protocol not in ("ip4", "ip6") or m.relayed:
        raise AddressError(f"listen multiaddr {m.text!r} must be an /ip4 or /ip6 address with a port, "
                           "such as /ip4/0.0.0.0/tcp/31337")
    return m.text


def validate_external_address(text: str) -> str:
    host, _ = parse_host_port(text, what="external address")
    if classify_host(host) == UNSPECIFIED:
        raise AddressError(f"external address {text!r} is a wildcard (0.0.0.0/::), which validators cannot dial; "
                           f"give your public host:port, such as {EXAMPLE_API}")
    return text.strip()


def fixed_port_host_maddrs(host_maddrs, announce_maddrs) -> list[str] | None:
    """Listen addresses with the announced TCP port instead of a random one (tcp/0), or None
    when nothing should change. An announced port must be the one p2pd listens on (or the
    one a router forwards to it); a random port changes on every restart."""
    ports = {parse_maddr(m).port for m in announce_maddrs if not parse_maddr(m).relayed}
    if len(ports) != 1:
        return None
    port = ports.pop()
    changed, out = False, []
    for m in host_maddrs:
        parsed = parse_maddr(m)
        if parsed.transport == "tcp" and parsed.port == 0:
            out.append(m.replace(f"/{parsed.transport}/0", f"/tcp/{port}", 1))
            changed = True
        else:
            out.append(m)
    return out if changed else None
