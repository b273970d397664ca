"""All-reduce over rate-limited links: dtrain's swarm vs hivemind's default averager, against the bound.

Topology (needs root + iproute2): one network namespace per peer, each with a veth pair
into a dedicated bridge namespace. ``tc tbf`` limits both directions of every link to
``--rate-mbit`` (egress on the peer side = upload, egress on the bridge side = download).
Traffic never leaves these namespaces. Every namespace is deleted on exit, on error, and
on Ctrl-C (try/finally + atexit + signal handlers).

For n peers averaging D bytes, butterfly all-reduce needs each peer to send and receive
2·D·(n−1)/n bytes, so ``bound = 2·D·(n−1)/n / B``; ``efficiency = bound / measured``.
Three implementations run in the same namespaces in the same run (same processes, same DHT):

* ``dtrain``: GradientSwarm with the production settings (``AveragingConfig()``, whose defaults
  are the config schema's: CenteredClip aggregation, work commitments in the gather and every
  received part checked against its claim), with a fresh work nonce per round as each epoch
  gets; only the lab's group size, timeouts and part size are set;
* ``dtrain-mean``: the ablation: the same with hivemind's weighted mean and no work
  commitments, i.e. dtrain's butterfly alone (its result is checked against the exact mean);
* ``butterfly``: dtrain's own butterfly (dtrain/swarm/butterfly.py) on its own P2P protocol over
  a group fixed before the round (the members found on the DHT, in index order, an equal share
  of the parts each), the weighted mean, the schema's wire codec and part size; every peer starts
  each round at the same instant of a shared clock, as members of an announced round do. Not
  yet the path `dtrain mine` ships: it has none of the checks of ``dtrain``;
* ``hivemind``: DecentralizedAverager with its defaults, only the matchmaking group
  size/time set so the n peers meet.

Time is measured per peer from the moment it enters RUNNING_ALLREDUCE until it holds the
result; a round takes as long as its slowest peer, and the figure is the median over rounds.
CPU is read from ``/proc/<pid>/stat`` (utime + stime) for each peer's whole process tree
(its own process, the DHT process, p2pd and the forked averager), before and after each
round, and reported as CPU seconds per MiB of the averaged vector, per peer (the mean over
peers; median and range over rounds), in total and per process.

    sudo python benchmarks/allreduce_netns.py --peers 4 --size-mb 16 --rate-mbit 100 --rounds 5 --json
    sudo python benchmarks/allreduce_netns.py --peers 8 --size-mb 16 --rate-mbit 25 --rounds 5 --json
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
# A worker's matchmaking gives up after this long (per attempt of a round).
WORKER_MATCHMAKING_TIMEOUT_S = 120


def have_netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


class NetnsLab:
    """Namespaces ``<tag>p<i>`` bridged through ``<tag>br``; every link rate-limited with tbf."""

    def __init__(self, peers: int, rate_mbit: float, tag: str | None = None, subnet_id: int | None = None,
                 peer_rates_mbit: dict[int, float] | None = None, tcp_cc: str | None = None):
        self.n = peers
        self.rate_mbit = rate_mbit
        self.peer_rates_mbit = dict(peer_rates_mbit or {})  # per-peer override (a throttled straggler)
        self.tcp_cc = tcp_cc  # the peers' TCP congestion control; None: what a new namespace inherits
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
            if self.tcp_cc:
                _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={self.tcp_cc}")
            rate = self.peer_rates_mbit.get(i, self.rate_mbit)
            self._tbf(ns, inner, rate)  # upload
            self._tbf(b, outer, rate)  # download

    def congestion_control(self) -> str:
        """The TCP congestion control the peers' sockets use (their namespace's default)."""
        return _run("ip", "netns", "exec", self.peer_ns[0], "sysctl", "-n", "net.ipv4.tcp_congestion_control").stdout.strip()

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
# CPU accounting: /proc/<pid>/stat of a peer's whole process tree
# ------------------------------------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    # the command name is in parentheses and may hold spaces: split after the last ')'
    return text[text.rindex(")") + 2:].split()


def _process_cpu_s(pid: int) -> float | None:
    """utime + stime of a live process (all its threads), in seconds."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (the DHT, its p2pd and the averager are forked from a peer)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


class CpuMeter:
    """CPU seconds used by one peer's process tree, by role: main (the peer's own process: its
    share of run_round, e.g. work commitments), averager (the forked averaging process: the
    butterfly's serialisation, checks and reduction), dht (the DHT process), p2pd (the libp2p
    daemon that carries every byte), other. The tree is listed once per implementation, after
    its averager is started, so a snapshot reads a handful of files."""

    def __init__(self, averager_pid: int | None, dht_pid: int | None):
        me = os.getpid()
        self.labels: dict[int, str] = {}
        for pid in _descendants(me):
            try:
                with open(f"/proc/{pid}/comm") as fh:
                    comm = fh.read().strip()
            except OSError:
                continue
            if pid == me:
                label = "main"
            elif pid == averager_pid:
                label = "averager"
            elif pid == dht_pid:
                label = "dht"
            elif comm.startswith("p2pd"):
                label = "p2pd"
            else:
                label = "other"
            self.labels[pid] = label

    def snapshot(self) -> dict[int, float]:
        out = {}
        for pid in self.labels:
            cpu = _process_cpu_s(pid)
            if cpu is not None:
                out[pid] = cpu
        return out

    def delta(self, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
        by_label: dict[str, float] = {}
        for pid, cpu in after.items():
            if pid in before:
                by_label[self.labels[pid]] = by_label.get(self.labels[pid], 0.0) + cpu - before[pid]
        by_label["total"] = sum(by_label.values())
        return by_label


# ------------------------------------------------------------------------------------------
# worker: runs inside one namespace
# ------------------------------------------------------------------------------------------

IMPLS = ("dtrain", "dtrain-mean", "butterfly", "hivemind")
LINGER_S = 5.0


def worker(args) -> int:
    import hashlib

    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage

    from dtrain.swarm.averaging import AveragingConfig, GradientSwarm
    from dtrain.swarm.node import SwarmNode, SwarmNodeConfig
    from dtrain.sketch import WORK_SKETCH_K, gradient_sketch
    from dtrain.training.work import PageWork, WorkReport, work_nonce

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    numel = int(args.size_mb * 2**20 / 4)
    data_dir = tempfile.mkdtemp(prefix="dtrain-netns-")  # the node's identity; removed at the end
    node = SwarmNode(
        SwarmNodeConfig(
            data_dir=data_dir,
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
    dht_pid = getattr(node.dht, "pid", None)

    def wire_bytes() -> tuple[int, int]:
        """(sent, received) bytes on this namespace's links so far: everything on the wire (the
        DHT, matchmaking and its BEGIN, libp2p framing, TCP/IP headers), not only all-reduce parts."""
        tx = rx = 0
        for dev in os.listdir("/sys/class/net"):
            if dev == "lo":
                continue
            with contextlib.suppress(OSError, ValueError):
                with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as fh:
                    tx += int(fh.read())
                with open(f"/sys/class/net/{dev}/statistics/rx_bytes") as fh:
                    rx += int(fh.read())
        return tx, rx

    def timed(step_control, meter: CpuMeter, poll=0.005):
        """Seconds from the moment this peer starts the butterfly until it holds the result, and
        the CPU its process tree spent in that time."""
        while step_control.stage != AveragingStage.RUNNING_ALLREDUCE and not step_control.done():
            time.sleep(poll)
        t0 = time.monotonic()
        cpu0 = meter.snapshot()
        with contextlib.suppress(Exception):  # a failed round is reported in its row, not as a crash
            step_control.result()
        t1 = time.monotonic()
        # CLOCK_MONOTONIC is one clock for every namespace: the orchestrator lines peers up with it
        return t1 - t0, meter.delta(cpu0, meter.snapshot()), dict(t_start=t0, t_end=t1)

    def check(data: torch.Tensor, exact_mean: bool) -> dict:
        digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]  # every peer must hold the same bits
        diff = (data.double() - expected).abs()
        bad = (diff > 1e-5).nonzero().flatten() if exact_mean else torch.zeros(0, dtype=torch.int64)
        return dict(max_abs_error=float(diff.max()), digest=digest, n_bad=int(bad.numel()),
                    bad_range=[int(bad.min()), int(bad.max())] if bad.numel() else [])

    out = []
    try:
        for impl in args.impls.split(","):
            if impl not in IMPLS:
                raise SystemExit(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")
            if impl in ("dtrain", "dtrain-mean"):
                prod = impl == "dtrain"
                # what `dtrain mine` ships (AveragingConfig's defaults are the config schema's, as
                # settings_from gives a neuron); the lab sets only its group and timeouts (and the part
                # size, when --part-size-bytes asks for another than the production rule's)
                cfg = AveragingConfig().replace(
                    prefix=f"bench_{impl}_{args.peers}", min_group_size=args.peers, target_group_size=args.peers,
                    # request_timeout below min_matchmaking_time (or matchmaking can deadlock), and
                    # wide: a follower whose leader answers late drops out of a group it is counted in
                    min_matchmaking_time_s=args.matchmaking_s, request_timeout_s=args.matchmaking_s / 2,
                    matchmaking_timeout_s=WORKER_MATCHMAKING_TIMEOUT_S,
                    allreduce_timeout_s=300, sender_timeout_s=args.sender_timeout,
                    part_size_bytes=args.part_size_bytes or None,
                    allow_state_sharing=False,
                )
                if args.wire:
                    cfg = cfg.replace(compression=args.wire)
                if not prod:  # the ablation: hivemind's weighted mean, no work commitments
                    cfg = cfg.replace(aggregation="mean", require_commitments=False)
                swarm = GradientSwarm(node.dht, [mine], "bench", cfg, report_type=WorkReport)
                meter = CpuMeter(swarm._averager.pid, dht_pid)
                try:
                    for r in range(-args.warmup, args.rounds):
                        data = mine.clone()
                        kwargs = dict(weight=1.0, cap=1.0)
                        if prod:
                            # a fresh nonce per round, as a new epoch gets in production; one page
                            # whose sketch is `samples` x the contribution's (a miner's work log)
                            nonce = work_nonce(f"bench-{args.peers}", r + args.warmup)
                            samples = 16
                            sketch = (gradient_sketch([mine], nonce, k=WORK_SKETCH_K) * samples).tolist()
                            page = PageWork(page=args.index, counter=0, samples=samples, loss=1.0, sketch=tuple(sketch))
                            report = WorkReport(epoch=r + args.warmup, pages=(page,))
                            kwargs = dict(weight=float(samples), cap=float(samples), work=report, work_nonce=nonce)
                        box = {}
                        cpu_start = meter.snapshot()
                        wire_start = wire_bytes()
                        th = threading.Thread(target=lambda: box.update(rec=swarm.run_round([data], **kwargs)))
                        th.start()
                        while swarm._step is None:  # set by run_round before it waits for the result
                            time.sleep(0.002)
                        seconds, cpu_allreduce, clock = timed(swarm._step, meter)
                        th.join()
                        cpu_round = meter.delta(cpu_start, meter.snapshot())
                        wire_end = wire_bytes()
                        rec = box["rec"]
                        swarm._step = None
                        if r < 0:
                            continue  # warm-up: connections, caches and lazy imports; not reported
                        out.append(dict(impl=impl, round=r, seconds=seconds, inner_allreduce_s=rec.allreduce_s,
                                        result_check_s=getattr(rec, "result_check_s", 0.0), **clock,
                                        cpu_allreduce=cpu_allreduce, cpu_round=cpu_round,
                                        local_equal=int((data == mine).sum()), peer_id=rec.local_peer_id,
                                        outcomes={p.peer_id: p.outcome.value for p in rec.peers},
                                        reasons={p.peer_id: p.reason for p in rec.peers if p.reason},
                                        ok=not rec.error and rec.fraction_averaged == 1.0
                                        and all(p.outcome.value == "SUCCESS" for p in rec.peers),
                                        error=rec.error, bytes_sent=rec.bytes_sent,
                                        bytes_received=rec.bytes_received, wire_tx=wire_end[0] - wire_start[0],
                                        wire_rx=wire_end[1] - wire_start[1], **check(data, exact_mean=not prod)))
                finally:
                    # A peer holds its result once it has every part of its own vector, possibly
                    # before it has sent its last averaged part to a slower sender; shutting its
                    # averager down at once would cut that sender's last part. Linger (untimed).
                    time.sleep(LINGER_S)
                    swarm.shutdown()
            elif impl == "butterfly":
                out.extend(_own_butterfly_rounds(args, node, mine, check, wire_bytes, dht_pid))
            else:  # hivemind's DecentralizedAverager, default configuration
                data = mine.clone()
                avg = DecentralizedAverager(
                    [data], node.dht, start=True, prefix=f"bench_hivemind_{args.peers}",
                    target_group_size=args.peers, min_group_size=args.peers,
                    min_matchmaking_time=args.matchmaking_s, request_timeout=args.matchmaking_s / 2,
                )
                meter = CpuMeter(avg.pid, dht_pid)
                try:
                    result = torch.empty_like(mine)
                    for r in range(-args.warmup, args.rounds):
                        cpu_start = meter.snapshot()
                        wire_start = wire_bytes()
                        # The caller's copies in and out are part of the round, as in run_round
                        # (which copies the contribution into the averaged buffers, and the
                        # average back): hivemind's step() leaves them to its caller.
                        with avg.get_tensors() as ts:
                            ts[0].copy_(mine)
                        ctl = avg.step(wait=False, timeout=120)
                        seconds, cpu_allreduce, clock = timed(ctl, meter)
                        with avg.get_tensors() as ts:
                            result.copy_(ts[0])
                        cpu_round = meter.delta(cpu_start, meter.snapshot())
                        wire_end = wire_bytes()
                        if r < 0:
                            continue
                        ok = ctl.done() and ctl.exception() is None if not ctl.cancelled() else False
                        out.append(dict(impl=impl, round=r, seconds=seconds, ok=ok, **clock,
                                        cpu_allreduce=cpu_allreduce, cpu_round=cpu_round,
                                        wire_tx=wire_end[0] - wire_start[0], wire_rx=wire_end[1] - wire_start[1],
                                        **check(result, exact_mean=True)))
                finally:
                    time.sleep(LINGER_S)
                    avg.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
        if os.environ.get("DTRAIN_NETNS_DEBUG"):
            print(json.dumps(out), file=sys.stderr)
        return 0
    finally:
        node.shutdown()
        shutil.rmtree(data_dir, ignore_errors=True)


def _own_butterfly_rounds(args, node, mine, check, wire_bytes, dht_pid) -> list[dict]:
    """The ``butterfly`` implementation's rounds (see the module docstring)."""
    import torch
    from hivemind.utils.timed_storage import get_dht_time

    from dtrain.swarm.averaging import AveragingConfig
    from dtrain.swarm.averaging.settings import part_size_for
    from dtrain.swarm.butterfly import ButterflyService, Membership
    from dtrain.swarm.codecs import part_codec
    from dtrain.swarm.transport import Transport

    cfg = AveragingConfig()
    codec = part_codec(args.wire or cfg.compression)
    part_bytes = args.part_size_bytes or part_size_for(mine.numel() * 4)
    part_values = max(1, part_bytes // 4)
    transport = Transport(node.dht, prefix=f"bench_butterfly_{args.peers}").start()
    service = ButterflyService(transport, start_timeout_s=60)
    meter = CpuMeter(os.getpid(), dht_pid)
    key = f"bench_butterfly_{args.peers}_members"
    peers: list[str] = []
    deadline = time.monotonic() + WORKER_MATCHMAKING_TIMEOUT_S
    while len(peers) < args.peers and time.monotonic() < deadline:
        node.dht.store(key, subkey=transport.peer_id, value=args.index, expiration_time=get_dht_time() + 600)
        found = node.dht.get(key, latest=True)
        members = found.value if found is not None and isinstance(found.value, dict) else {}
        peers = [p for p, _ in sorted(((p, v.value) for p, v in members.items()), key=lambda item: item[1])]
        time.sleep(0.5)
    if len(peers) < args.peers:
        raise SystemExit(f"only {len(peers)} of {args.peers} butterfly members showed up")
    num_parts = -(-mine.numel() // part_values)
    shares = tuple(num_parts // args.peers + (k < num_parts % args.peers) for k in range(args.peers))
    rows = []
    try:
        for r in range(-args.warmup, args.rounds):
            data = mine.clone()
            parts = list(data.split(part_values))
            membership = Membership(f"bench-{r}", tuple(peers), senders=tuple(range(args.peers)),
                                    weights=(1.0,) * args.peers, shares=shares)
            # every member starts at the same instant (CLOCK_MONOTONIC is one clock for all namespaces)
            start = (int(time.monotonic()) // 2 + 2) * 2.0
            time.sleep(max(0.0, start - time.monotonic()))
            cpu_start, wire_start = meter.snapshot(), wire_bytes()
            t0 = time.monotonic()
            outcome = transport.run(service.run(membership, parts, codec, sender_timeout_s=args.sender_timeout,
                                                reducer_timeout_s=60.0), timeout_s=600)
            t1 = time.monotonic()
            cpu = meter.delta(cpu_start, meter.snapshot())
            wire_end = wire_bytes()
            time.sleep(1.0)  # the slower members' last replies, before the next round's clock
            if r < 0:
                continue
            ok = not outcome.failed_reducers and not outcome.banned and not outcome.unaveraged_parts
            rows.append(dict(impl="butterfly", round=r, seconds=t1 - t0, t_start=t0, t_end=t1, ok=ok,
                             cpu_allreduce=cpu, cpu_round=cpu, bytes_sent=outcome.bytes_sent,
                             bytes_received=outcome.bytes_received, wire_tx=wire_end[0] - wire_start[0],
                             wire_rx=wire_end[1] - wire_start[1],
                             error="; ".join(f"reducer {k}: {why}" for k, why in outcome.failed_reducers.items()),
                             **check(data, exact_mean=codec.name == "none")))
    finally:
        time.sleep(LINGER_S)
        transport.shutdown()
    return rows


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
              matchmaking_s: float = 3.0, timeout_s: float | None = None, peer_rates_mbit: dict | None = None,
              sender_timeout_s: float = 60.0, raw: list | None = None, warmup: int = 0,
              tcp_cc: str | None = None, wire: str = "") -> dict:
    """Run one lab; ``raw`` (if given) receives every worker's per-round rows. ``timeout_s``: how
    long to wait for a worker's results (None: enough for every round to take three times its
    bound, plus one lost matchmaking per implementation; a baseline that loses a round must
    not end the run without the figures of the others)."""
    size_bytes = int(size_mb * 2**20 / 4) * 4
    bound = 2.0 * size_bytes * (peers - 1) / peers / (rate_mbit * 1e6 / 8)
    if timeout_s is None:
        timeout_s = len(impls.split(",")) * ((rounds + warmup) * (3 * bound + 30) + WORKER_MATCHMAKING_TIMEOUT_S)
    procs: list[subprocess.Popen] = []
    # Each worker logs (hivemind's warnings included) to its own file; a worker that does not
    # finish is reported with the tail of its log, so a failure names its cause.
    logs = tempfile.TemporaryDirectory(prefix="dtrain-netns-logs-")
    log_files: list = []
    with logs, NetnsLab(peers, rate_mbit, peer_rates_mbit=peer_rates_mbit, tcp_cc=tcp_cc) as lab:
        congestion_control = lab.congestion_control()
        try:
            def start(i: int, boot: str | None) -> subprocess.Popen:
                argv = [sys.executable, os.path.abspath(__file__), "--worker", "--index", str(i), "--ip", lab.ip(i),
                        "--peers", str(peers), "--size-mb", str(size_mb), "--rounds", str(rounds), "--impls", impls,
                        "--part-size-bytes", str(part_size_bytes), "--matchmaking-s", str(matchmaking_s),
                        "--sender-timeout", str(sender_timeout_s), "--warmup", str(warmup), "--wire", wire]
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
                    # Every worker's state: a round needs all of them, so the one that stalls is
                    # often waiting for another that died or never joined.
                    others = "".join(f"\n--- worker {j} (rc={p.poll()}), its log ends:\n{_tail(logs.name, j, 15)}"
                                     for j, p in enumerate(procs) if j != i)
                    raise TimeoutError(f"worker {i}: {exc}; its log ends:\n{_tail(logs.name, i)}{others}") from None

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
    from dtrain.swarm.averaging.settings import part_size_for

    summary: dict = dict(peers=peers, size_mb=size_mb, rate_mbit=rate_mbit, bound_s=bound, rounds=rounds,
                         dtrain_wire=wire or "the schema's allreduce.compression",
                         tcp_congestion_control=congestion_control,
                         warmup_rounds=warmup, dtrain_part_size_bytes=part_size_bytes or part_size_for(size_bytes))
    lossless = wire in ("", "none")  # the ablation's result is the exact mean only over fp32
    for impl in impls.split(","):
        summary[impl] = summarize_impl([row for res in results for row in res if row["impl"] == impl],
                                       rounds, size_mb, bound,
                                       exact_mean=impl == "hivemind" or (impl in ("dtrain-mean", "butterfly") and lossless),
                                       identical=impl != "hivemind", payload=2.0 * size_bytes * (peers - 1) / peers)
        # bytes each peer moves per direction over the median time: the link rate at efficiency 1
        summary[impl]["busbw_mbit"] = rate_mbit * summary[impl]["efficiency"]
        # against the bound of the bytes this implementation put on the wire (its codec's own
        # bound): what a compressed wire makes of the link, not only how much less it sends
        busy = summary[impl].get("wire_bytes_per_peer")
        own_bound = busy["median"] / (rate_mbit * 1e6 / 8) if busy else None
        summary[impl]["own_bound_s"] = own_bound
        summary[impl]["efficiency_own_bytes"] = (own_bound / summary[impl]["seconds"]
                                                 if own_bound and summary[impl]["seconds"] > 0 else None)
    for impl in ("dtrain", "dtrain-mean", "butterfly"):
        if impl in summary and "hivemind" in summary:
            summary[f"{impl}_vs_hivemind_speedup"] = summary["hivemind"]["seconds"] / summary[impl]["seconds"]
    return summary


def _median_range(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def summarize_impl(rows: list[dict], rounds: int, size_mb: float, bound: float, *, exact_mean: bool,
                   identical: bool, payload: float = 0.0) -> dict:
    """One implementation's figures over its rounds: time of the slowest peer per round (a round
    ends when the last peer holds the result), efficiency, and CPU seconds per MiB averaged (the
    size of the vector), per peer: the mean over the peers of each round, then median and range
    over the rounds."""
    per_round, cpu_round, cpu_allreduce, roles, skew, span = [], [], [], {}, [], []
    wire_mean, wire_max = [], []
    digests_agree = True
    for r in range(rounds):
        rnd = [row for row in rows if row["round"] == r]
        per_round.append(max(row["seconds"] for row in rnd))
        # how far apart the peers entered the butterfly, and first start to last finish
        skew.append(max(row["t_start"] for row in rnd) - min(row["t_start"] for row in rnd))
        span.append(max(row["t_end"] for row in rnd) - min(row["t_start"] for row in rnd))
        cpu_round.append(statistics.fmean(row["cpu_round"]["total"] for row in rnd) / size_mb)
        cpu_allreduce.append(statistics.fmean(row["cpu_allreduce"]["total"] for row in rnd) / size_mb)
        for role in {k for row in rnd for k in row["cpu_round"] if k != "total"}:
            per_peer = statistics.fmean(row["cpu_round"].get(role, 0.0) for row in rnd)
            roles.setdefault(role, []).append(per_peer / size_mb)
        digests_agree &= len({row["digest"] for row in rnd}) == 1
        if all("wire_tx" in row for row in rnd):
            # the busier direction of each peer: what its link has to carry
            busiest = [max(row["wire_tx"], row["wire_rx"]) for row in rnd]
            wire_mean.append(statistics.fmean(busiest))
            wire_max.append(max(busiest))
    measured = statistics.median(per_round)
    out = dict(
        seconds_per_round=per_round,
        seconds=measured,
        seconds_range=[min(per_round), max(per_round)],
        start_skew_s=statistics.median(skew),
        span_s=statistics.median(span),
        # the receivers' result check after the butterfly (in `seconds`; the slowest peer's per round)
        result_check_s=_median_range([max(row.get("result_check_s", 0.0) for row in rows if row["round"] == r)
                                      for r in range(rounds)]),
        efficiency=bound / measured if measured > 0 else 0.0,
        efficiency_range=[bound / max(per_round), bound / min(per_round)] if min(per_round) > 0 else [0.0, 0.0],
        # CPU of the whole run_round/step call (commitments, matchmaking, butterfly) and of the
        # butterfly alone, per MiB of the averaged vector, per peer
        cpu_s_per_mb=_median_range(cpu_round),
        cpu_s_per_mb_allreduce=_median_range(cpu_allreduce),
        cpu_s_per_mb_by_process={role: statistics.median(v) for role, v in sorted(roles.items())},
        max_abs_error=max(row["max_abs_error"] for row in rows),
        # bytes on the wire per peer per round, in its busier direction (mean over peers; and the
        # busiest peer), over the butterfly's payload 2·D·(n−1)/n: 1.0 is the bound's own bytes
        wire_bytes_per_peer=_median_range(wire_mean) if wire_mean else None,
        wire_bytes_busiest_peer=_median_range(wire_max) if wire_max else None,
        wire_over_payload=(statistics.median(wire_mean) / payload if wire_mean and payload else None),
        wire_over_payload_busiest=(statistics.median(wire_max) / payload if wire_max and payload else None),
        all_ok=all(row["ok"] for row in rows) and (not exact_mean or all(row["n_bad"] == 0 for row in rows)),
        # why a round was not clean, so a failed run names its cause
        errors=sorted({(row.get("error") or "")[:200] for row in rows if row.get("error")}
                      | {f"{pid}: {why}"[:200] for row in rows for pid, why in (row.get("reasons") or {}).items()}),
    )
    if identical:  # dtrain's peers must hold bit-identical results (one optimizer step everywhere)
        out["identical_results"] = digests_agree
        out["all_ok"] = out["all_ok"] and digests_agree
    return out


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _table(results: list[dict]) -> str:
    lines = ["| peers | link | bound | implementation | seconds (median, range) | efficiency | vs hivemind "
             "| CPU-s/MB round (median, range) | CPU-s/MB butterfly | wire / payload (mean peer, busiest) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for impl in IMPLS:
            if impl not in res:
                continue
            s = res[impl]
            speed = res.get(f"{impl}_vs_hivemind_speedup")
            cpu = s["cpu_s_per_mb"]
            lines.append(
                f"| {res['peers']} | {res['rate_mbit']:g} Mbit | {res['bound_s']:.2f} s | {impl} "
                f"| {s['seconds']:.2f} ({s['seconds_range'][0]:.2f}–{s['seconds_range'][1]:.2f}) "
                f"| {s['efficiency']:.2f} | {'' if speed is None else f'{speed:.2f}×'} "
                f"| {cpu['median']:.3f} ({cpu['min']:.3f}–{cpu['max']:.3f}) "
                f"| {s['cpu_s_per_mb_allreduce']['median']:.3f} "
                f"| {_ratio(s.get('wire_over_payload'))}, {_ratio(s.get('wire_over_payload_busiest'))} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--size-mb", type=float, default=16.0)
    ap.add_argument("--rate-mbit", type=float, nargs="+", default=[100.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--impls", default="dtrain,dtrain-mean,hivemind",
                    help="dtrain: what `dtrain mine` ships (centered_clip, work commitments); dtrain-mean: the "
                         "ablation (weighted mean, no commitments); butterfly: dtrain's own butterfly over a fixed "
                         "group (weighted mean, no checks yet); hivemind: stock DecentralizedAverager")
    ap.add_argument("--part-size-bytes", type=int, default=0,
                    help="dtrain part size; 0 (default): the production rule, settings.part_size_for (hivemind "
                         "keeps its default)")
    ap.add_argument("--matchmaking-s", type=float, default=3.0)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed rounds per implementation before the measured ones (first connections)")
    ap.add_argument("--tcp-cc", default=None,
                    help="TCP congestion control of the peers' namespaces (e.g. cubic, bbr); default: what a new "
                         "namespace inherits from the host (reported as tcp_congestion_control)")
    ap.add_argument("--wire", default="",
                    help="the dtrain implementations' codec (none, fp16, 8bit, ternary); default: the schema's "
                         "allreduce.compression, what dtrain mine ships")
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
    load_before = os.getloadavg()
    results = []
    for rate in args.rate_mbit:
        for n in args.peers:
            results.append(run_group(n, args.size_mb, rate, args.rounds, args.impls, args.part_size_bytes,
                                     args.matchmaking_s, warmup=args.warmup, tcp_cc=args.tcp_cc, wire=args.wire))
            if not args.json:
                print(_table(results[-1:]), flush=True)
    # The goal (issue #21): what `dtrain mine` ships (dtrain) within 0.8 of the bound and no slower
    # than hivemind's default averager in the same run; the ablation (dtrain-mean) is reported beside it.
    def met(impl: str) -> bool | None:
        rows = [r for r in results if impl in r]
        if not rows:
            return None
        return all(r[impl]["efficiency"] >= 0.8 and r.get(f"{impl}_vs_hivemind_speedup", 1.0) >= 1.0
                   and r[impl]["all_ok"] for r in rows)

    doc = dict(results=results, target_efficiency=0.8, target_met=met("dtrain"),
               target_met_ablation=met("dtrain-mean"),
               machine=dict(cpus=os.cpu_count(), loadavg_before=load_before, loadavg_after=os.getloadavg()))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(_table(results))
        print(f"load average before {load_before}, after {doc['machine']['loadavg_after']}")
    return 0 if doc["target_met"] in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
