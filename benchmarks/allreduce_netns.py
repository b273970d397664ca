"""All-reduce over rate-limited links: dtrain's swarm vs hivemind's default averager, against the bound.

Topology (needs root + iproute2): one network namespace per peer, each with a veth pair
into a dedicated bridge namespace. ``tc tbf`` limits both directions of every link to
``--rate-mbit`` (egress on the peer side = upload, egress on the bridge side = download).
Traffic never leaves these namespaces. Every namespace is deleted on exit, on error, and
on Ctrl-C (try/finally + atexit + signal handlers).

For n peers averaging D bytes, butterfly all-reduce needs each peer to send and receive
2·D·(n−1)/n bytes, so ``bound = 2·D·(n−1)/n / B``; ``efficiency = bound / measured``.
Both implementations run in the same namespaces in the same run (same processes, same DHT):
``dtrain`` (GradientSwarm) and ``hivemind`` (DecentralizedAverager with its defaults, only the
matchmaking group size/time set so the n peers meet).

    sudo python benchmarks/allreduce_netns.py --peers 4 8 --size-mb 16 --rate-mbit 100 --json
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SUBNET = "10.213.{}.{}"  # private, only inside our namespaces


def have_netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


class NetnsLab:
    """Namespaces ``<tag>p<i>`` bridged through ``<tag>br``; every link rate-limited with tbf."""

    def __init__(self, peers: int, rate_mbit: float, tag: str | None = None, subnet_id: int | None = None,
                 peer_rates_mbit: dict[int, float] | None = None):
        self.n = peers
        self.rate_mbit = rate_mbit
        self.peer_rates_mbit = dict(peer_rates_mbit or {})  # per-peer override (a throttled straggler)
        self.tag = tag or f"dt{os.getpid() % 100000}"
        self.subnet_id = subnet_id if subnet_id is not None else (os.getpid() % 200) + 20
        self.bridge_ns = f"{self.tag}br"
        self.peer_ns = [f"{self.tag}p{i}" for i in range(peers)]
        self._created: list[str] = []
        self._closed = False

    def ip(self, i: int) -> str:
        return SUBNET.format(self.subnet_id, i + 1)

    def __enter__(self) -> "NetnsLab":
        atexit.register(self.close)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tbf(self, ns: str, dev: str, rate_mbit: float) -> None:
        # burst ~ 1 ms at line rate (>= MTU); queue of 100 ms so parallel TCP flows are not tail-dropped
        burst = max(int(rate_mbit * 1e6 / 8 / 1000), 16 * 1024)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms")

    def _setup(self) -> None:
        _run("ip", "netns", "add", self.bridge_ns)
        self._created.append(self.bridge_ns)
        b = self.bridge_ns
        _run("ip", "netns", "exec", b, "ip", "link", "set", "lo", "up")
        _run("ip", "netns", "exec", b, "ip", "link", "add", "br0", "type", "bridge")
        _run("ip", "netns", "exec", b, "ip", "link", "set", "br0", "up")
        for i, ns in enumerate(self.peer_ns):
            _run("ip", "netns", "add", ns)
            self._created.append(ns)
            inner, outer = f"{self.tag}a{i}", f"{self.tag}b{i}"
            # create the pair inside the bridge namespace, then move one end: the root namespace
            # never holds (or routes through) any of our interfaces
            _run("ip", "netns", "exec", b, "ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            _run("ip", "netns", "exec", b, "ip", "link", "set", inner, "netns", ns)
            _run("ip", "netns", "exec", b, "ip", "link", "set", outer, "master", "br0")
            _run("ip", "netns", "exec", b, "ip", "link", "set", outer, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", inner)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            rate = self.peer_rates_mbit.get(i, self.rate_mbit)
            self._tbf(ns, inner, rate)  # upload
            self._tbf(b, outer, rate)  # download

    def popen(self, i: int, argv: list[str], stderr=None) -> subprocess.Popen:
        """Start ``argv`` in peer ``i``'s namespace; ``stderr`` is a file to log to (default: ours)."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.peer_ns[i], *argv],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,  # its own process group: killpg takes p2pd down with it
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ns in reversed(self._created):
            # processes still inside keep a namespace alive: kill them first
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", ns, check=False)
        self._created.clear()


# ------------------------------------------------------------------------------------------
# worker: runs inside one namespace
# ------------------------------------------------------------------------------------------


def worker(args) -> int:
    import torch

    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage

    from dtrain.swarm.averaging import AveragingConfig, GradientSwarm
    from dtrain.swarm.node import NodeConfig, SwarmNode

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    numel = int(args.size_mb * 2**20 / 4)
    node = SwarmNode(
        NodeConfig(
            data_dir=tempfile.mkdtemp(prefix="dtrain-netns-"),
            host_maddrs=[f"/ip4/{args.ip}/tcp/0"],
            initial_peers=[args.initial_peer] if args.initial_peer else [],
            extra_dht_kwargs=dict(nat_port_map=False),  # nothing to map inside a namespace
        )
    ).start()
    print("MADDR " + node.visible_maddrs()[0], flush=True)
    # the exact mean, from every peer's seed, to check the result
    expected = torch.zeros(numel, dtype=torch.float64)
    for k in range(args.peers):
        expected += torch.randn(numel, generator=torch.Generator().manual_seed(k)).double()
    expected /= args.peers
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(args.index))

    def timed(step_control, poll=0.002):
        # time from the moment this peer starts the butterfly until it holds the result
        while step_control.stage != AveragingStage.RUNNING_ALLREDUCE and not step_control.done():
            time.sleep(poll)
        t0 = time.monotonic()
        with contextlib.suppress(Exception):  # a failed round is reported in its row, not as a crash
            step_control.result()
        return time.monotonic() - t0

    out = []
    try:
        for impl in args.impls.split(","):
            if impl == "dtrain":
                cfg = AveragingConfig(
                    prefix=f"bench_dtrain_{args.peers}", min_group_size=args.peers, target_group_size=args.peers,
                    # request_timeout below min_matchmaking_time (or matchmaking can deadlock), and
                    # wide: a follower whose leader answers late drops out of a group it is counted in
                    min_matchmaking_time_s=args.matchmaking_s, request_timeout_s=args.matchmaking_s / 2,
                    matchmaking_timeout_s=120,
                    allreduce_timeout_s=300, sender_timeout_s=args.sender_timeout, part_size_bytes=args.part_size_bytes,
                    allow_state_sharing=False,
                )
                swarm = GradientSwarm(node.dht, [mine], "bench", cfg)
                try:
                    for r in range(args.rounds):
                        data = mine.clone()
                        box = {}
                        th = threading.Thread(target=lambda: box.update(rec=swarm.run_round([data], 1.0, 1.0)))
                        th.start()
                        while swarm._step is None:  # set by run_round before it waits for the result
                            time.sleep(0.002)
                        seconds = timed(swarm._step)
                        th.join()
                        rec = box["rec"]
                        diff = (data.double() - expected).abs()
                        err = float(diff.max())
                        bad = (diff > 1e-5).nonzero().flatten()
                        out.append(dict(impl=impl, round=r, seconds=seconds, inner_allreduce_s=rec.allreduce_s,
                                        n_bad=int(bad.numel()), bad_range=[int(bad.min()), int(bad.max())] if bad.numel() else [],
                                        local_equal=int((data == mine).sum()), peer_id=rec.local_peer_id,
                                        outcomes={p.peer_id: p.outcome.value for p in rec.peers},
                                        reasons={p.peer_id: p.reason for p in rec.peers if p.reason},
                                        ok=not rec.error and rec.fraction_averaged == 1.0, error=rec.error,
                                        max_abs_error=err,
                                        bytes_sent=rec.bytes_sent, bytes_received=rec.bytes_received))
                        swarm._step = None
                finally:
                    swarm.shutdown()
            else:  # hivemind's DecentralizedAverager, default configuration
                data = mine.clone()
                avg = DecentralizedAverager(
                    [data], node.dht, start=True, prefix=f"bench_hivemind_{args.peers}",
                    target_group_size=args.peers, min_group_size=args.peers,
                    min_matchmaking_time=args.matchmaking_s, request_timeout=args.matchmaking_s / 2,
                )
                try:
                    for r in range(args.rounds):
                        with avg.get_tensors() as ts:
                            ts[0].copy_(mine)
                        ctl = avg.step(wait=False, timeout=120)
                        seconds = timed(ctl)
                        with avg.get_tensors() as ts:
                            err = float((ts[0].double() - expected).abs().max())
                        out.append(dict(impl=impl, round=r, seconds=seconds, ok=True, max_abs_error=err))
                finally:
                    avg.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
        if os.environ.get("DTRAIN_NETNS_DEBUG"):
            print(json.dumps(out), file=sys.stderr)
        return 0
    finally:
        node.shutdown()


# ------------------------------------------------------------------------------------------
# orchestrator
# ------------------------------------------------------------------------------------------


def _read_line(proc: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    box: list = []

    def reader():
        for line in proc.stdout:
            if line.startswith(prefix):
                box.append(line[len(prefix):].strip())
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        raise TimeoutError(f"worker did not print {prefix!r} in {timeout_s}s (rc={proc.poll()})")
    return box[0]


def _tail(log_dir: str, i: int, lines: int = 40) -> str:
    try:
        with open(os.path.join(log_dir, f"worker{i}.log")) as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return "(no log)"


def run_group(peers: int, size_mb: float, rate_mbit: float, rounds: int, impls: str, part_size_bytes: int,
              matchmaking_s: float = 3.0, timeout_s: float = 400, peer_rates_mbit: dict | None = None,
              sender_timeout_s: float = 60.0, raw: list | None = None) -> dict:
    """Run one lab; ``raw`` (if given) receives every worker's per-round rows."""
    procs: list[subprocess.Popen] = []
    # Each worker logs (hivemind's warnings included) to its own file; a worker that does not
    # finish is reported with the tail of its log, so a failure names its cause.
    logs = tempfile.TemporaryDirectory(prefix="dtrain-netns-logs-")
    log_files: list = []
    with logs, NetnsLab(peers, rate_mbit, peer_rates_mbit=peer_rates_mbit) as lab:
        try:
            def start(i: int, boot: str | None) -> subprocess.Popen:
                argv = [sys.executable, os.path.abspath(__file__), "--worker", "--index", str(i), "--ip", lab.ip(i),
                        "--peers", str(peers), "--size-mb", str(size_mb), "--rounds", str(rounds), "--impls", impls,
                        "--part-size-bytes", str(part_size_bytes), "--matchmaking-s", str(matchmaking_s),
                        "--sender-timeout", str(sender_timeout_s)]
                if boot:
                    argv += ["--initial-peer", boot]
                if os.environ.get("DTRAIN_NETNS_DEBUG"):
                    return lab.popen(i, argv)
                log_files.append(open(os.path.join(logs.name, f"worker{i}.log"), "w"))
                return lab.popen(i, argv, stderr=log_files[-1])

            def read(i: int, prefix: str, limit_s: float) -> str:
                try:
                    return _read_line(procs[i], prefix, limit_s)
                except TimeoutError as exc:
                    raise TimeoutError(f"worker {i}: {exc}; its log ends:\n{_tail(logs.name, i)}") from None

            procs.append(start(0, None))
            boot = read(0, "MADDR ", 60)
            for i in range(1, peers):
                procs.append(start(i, boot))
            results = [json.loads(read(i, "RESULT ", timeout_s)) for i in range(peers)]
            if raw is not None:
                raw.extend(results)
            for p in procs:  # workers exit by themselves after RESULT (clean DHT/p2pd shutdown)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(30)
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                with contextlib.suppress(Exception):
                    p.wait(10)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            for fh in log_files:
                fh.close()
    size_bytes = int(size_mb * 2**20 / 4) * 4
    bound = 2.0 * size_bytes * (peers - 1) / peers / (rate_mbit * 1e6 / 8)
    summary: dict = dict(peers=peers, size_mb=size_mb, rate_mbit=rate_mbit, bound_s=bound, rounds=rounds)
    for impl in impls.split(","):
        per_round = []
        for r in range(rounds):
            rows = [row for res in results for row in res if row["impl"] == impl and row["round"] == r]
            per_round.append(max(row["seconds"] for row in rows))  # the round ends when the last peer is done
        rows = [row for res in results for row in res if row["impl"] == impl]
        measured = statistics.median(per_round)
        summary[impl] = dict(
            seconds_per_round=per_round,
            seconds=measured,
            efficiency=bound / measured if measured > 0 else 0.0,
            busbw_mbit=2.0 * size_bytes * (peers - 1) / peers * 8 / 1e6 / measured if measured > 0 else 0.0,
            max_abs_error=max(row["max_abs_error"] for row in rows),
            all_ok=all(row["ok"] for row in rows),
        )
    if "dtrain" in summary and "hivemind" in summary:
        summary["dtrain_vs_hivemind_speedup"] = summary["hivemind"]["seconds"] / summary["dtrain"]["seconds"]
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--size-mb", type=float, default=16.0)
    ap.add_argument("--rate-mbit", type=float, nargs="+", default=[100.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--impls", default="dtrain,hivemind")
    ap.add_argument("--part-size-bytes", type=int, default=2**17, help="dtrain part size (hivemind keeps its default)")
    ap.add_argument("--matchmaking-s", type=float, default=3.0)
    ap.add_argument("--json", action="store_true")
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ip", default="", help=argparse.SUPPRESS)
    ap.add_argument("--initial-peer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--sender-timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.peers = args.peers[0]
        return worker(args)
    if not have_netns():
        print("needs root, ip and tc (apt-get install iproute2)", file=sys.stderr)
        return 2

    def _sig(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _sig)
    results = []
    for rate in args.rate_mbit:
        for n in args.peers:
            results.append(run_group(n, args.size_mb, rate, args.rounds, args.impls, args.part_size_bytes,
                                     args.matchmaking_s))
        if not args.json:
            print(json.dumps(results[-1], indent=2), flush=True)
    target_ok = all(
        r["dtrain"]["efficiency"] >= 0.8 and r.get("dtrain_vs_hivemind_speedup", 1.0) >= 0.95 for r in results
        if "dtrain" in r
    )
    doc = dict(results=results, target_efficiency=0.8, target_met=target_ok)
    if args.json:
        print(json.dumps(doc, indent=2))
    return 0 if target_ok else 1


if __name__ == "__main__":
    sys.exit(main())
