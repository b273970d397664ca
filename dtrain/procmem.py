"""A neuron's process tree in /proc: its processes (the session a sandbox neuron leads, p2pd
and hivemind's forked DHT and averager with it), what each is, and the memory, descriptors and
threads each holds, and the heap a process gives back (``trim_heap``). Used by the sandbox's
peak-memory summary, the memory and soak benchmarks, offloading and the averager.

Linux only: elsewhere every reading is empty (``available()`` says which)."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

KINDS = ("neuron", "dht", "averager", "p2pd", "torch_shm", "forked", "other")
METRICS = ("pss", "rss", "anon", "uss", "fds", "threads", "procs")


def trim_heap() -> bool:
    """Return the C heap's free pages to the system (glibc's malloc_trim). Tensors of a few MiB
    come from the heap, and freeing them (an offload, a round's parts in the averager's many
    threads) leaves their pages with the process until trimmed. False where it is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def available() -> bool:
    """Whether this system has a /proc these readings come from."""
    return os.path.exists("/proc/self/smaps_rollup") or os.path.exists("/proc/self/status")


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return None


def proc_stat(pid: int) -> dict | None:
    """comm, ppid, session and start time (clock ticks) of a process from /proc/PID/stat."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    # comm is in parentheses and may itself hold spaces or parentheses: split at the last ')'.
    lpar, rpar = text.find("("), text.rfind(")")
    if lpar < 0 or rpar < 0:
        return None
    fields = text[rpar + 2:].split()
    try:
        return {"pid": pid, "comm": text[lpar + 1:rpar], "state": fields[0], "ppid": int(fields[1]),
                "pgrp": int(fields[2]), "session": int(fields[3]), "start": int(fields[19])}
    except (IndexError, ValueError):
        return None


def all_processes() -> dict[int, dict]:
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None and st["state"] != "Z":  # a zombie holds no memory, fds or threads
                out[st["pid"]] = st
    return out


def process_tree(root: int, table: dict[int, dict] | None = None, *, session: bool = True) -> list[dict]:
    """The process ``root`` and all its descendants; with ``session``, also every other process
    of the session ``root`` leads (one the kernel re-parented away from it still belongs to it)."""
    table = all_processes() if table is None else table
    if root not in table:
        return []
    members = {root}
    if session and table[root]["session"] == root:
        members |= {pid for pid, st in table.items() if st["session"] == root}
    children: dict[int, list[int]] = {}
    for pid, st in table.items():
        children.setdefault(st["ppid"], []).append(pid)
    stack = list(members)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in members:
                members.add(child)
                stack.append(child)
    return [table[pid] for pid in sorted(members)]


def _status_kb(text: str, key: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(key + ":"):
            parts = line.split()
            try:
                return int(parts[1])
            except (IndexError, ValueError):
                return None
    return None


def process_sample(pid: int) -> dict | None:
    """Memory in bytes, open fds and threads of one process; None if it has gone.

    pss: Pss (smaps_rollup), rss: VmRSS, anon: RssAnon + RssShmem (status), uss: Private_Clean +
    Private_Dirty (smaps_rollup). Pss falls back to VmRSS and uss to 0 where smaps_rollup cannot
    be read (kernels before 4.14, or another user's process)."""
    status = _read(f"/proc/{pid}/status")
    if status is None:
        return None
    rss_kb = _status_kb(status, "VmRSS") or 0  # kernel threads / exiting processes have none
    anon_kb = (_status_kb(status, "RssAnon") or 0) + (_status_kb(status, "RssShmem") or 0)
    threads = _status_kb(status, "Threads") or 0
    rollup = _read(f"/proc/{pid}/smaps_rollup")
    pss_kb = _status_kb(rollup, "Pss") if rollup else None
    uss_kb = ((_status_kb(rollup, "Private_Clean") or 0) + (_status_kb(rollup, "Private_Dirty") or 0)) if rollup else 0
    fd_types = open_fd_types(pid)
    return {"pss": (pss_kb if pss_kb is not None else rss_kb) * 1024, "rss": rss_kb * 1024,
            "anon": anon_kb * 1024, "uss": uss_kb * 1024,
            "fds": sum(fd_types.values()), "threads": threads, "procs": 1, "pss_exact": pss_kb is not None,
            "fd_types": fd_types}


def open_fd_types(pid: int) -> dict[str, int]:
    """Open descriptors of ``pid`` by what they point at: socket, pipe, anon_inode (eventfd,
    epoll...), file, or other; so a rise can be traced to a kind of resource."""
    counts: dict[str, int] = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return counts
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed between the listing and the read
        kind = target.split(":", 1)[0] if target.startswith(("socket:", "pipe:", "anon_inode:")) else \
            ("file" if target.startswith("/") else "other")
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _cmdline(pid: int) -> list[str]:
    text = _read(f"/proc/{pid}/cmdline") or ""
    return [part for part in text.split("\0") if part]


def classify(tree: list[dict], root: int) -> dict[int, str]:
    """pid -> kind: the neuron (the root), p2pd, hivemind's DHT (the forked child that started
    p2pd), hivemind's averager (the other forked child of the neuron, the oldest if several),
    "forked" (any further fork of the neuron's program) or "other"."""
    kinds: dict[int, str] = {}
    root_cmd = _cmdline(root)
    parents_of_p2pd = set()
    for st in tree:
        cmd = _cmdline(st["pid"])
        if st["comm"] == "p2pd" or (cmd and os.path.basename(cmd[0]) == "p2pd"):
            kinds[st["pid"]] = "p2pd"
            parents_of_p2pd.add(st["ppid"])
    forks = []
    for st in tree:
        pid = st["pid"]
        if pid in kinds:
            continue
        if pid == root:
            kinds[pid] = "neuron"
        elif st["comm"].startswith("torch_shm"):
            kinds[pid] = "torch_shm"
        elif pid in parents_of_p2pd:
            kinds[pid] = "dht"
        elif _cmdline(pid) == root_cmd:
            forks.append(st)
        else:
            kinds[pid] = "other"
    forks.sort(key=lambda st: (st["start"], st["pid"]))
    for i, st in enumerate(forks):
        kinds[st["pid"]] = "averager" if i == 0 else "forked"
    return kinds


def tree_sample(root: int, table: dict[int, dict] | None = None) -> dict | None:
    """Totals and per-kind totals over a neuron's process tree; None if the neuron has gone."""
    tree = process_tree(root, table)
    if not tree:
        return None
    kinds = classify(tree, root)
    total = dict.fromkeys(METRICS, 0)
    by_kind: dict[str, dict] = {}
    exact = True
    for st in tree:
        s = process_sample(st["pid"])
        if s is None:
            continue
        exact = exact and s["pss_exact"]
        bucket = by_kind.setdefault(kinds.get(st["pid"], "other"), {**dict.fromkeys(METRICS, 0), "fd_types": {}})
        for m in METRICS:
            total[m] += s[m]
            bucket[m] += s[m]
        for kind, count in s["fd_types"].items():
            bucket["fd_types"][kind] = bucket["fd_types"].get(kind, 0) + count
    return {**total, "pss_exact": exact, "kinds": by_kind}


class PeakMemory:
    """The peak Pss of each tracked process tree, and of each kind of process in it, sampled in
    a background thread every ``interval_s``. Pss, not RSS: the DHT and averager are forked from
    the neuron and share its copy-on-write pages, which Pss counts once across the three."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self._roots: dict[str, int] = {}
        self._peaks: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, name: str, pid: int) -> None:
        with self._lock:
            self._roots[name] = pid

    def start(self) -> None:
        if self._thread is None and available():
            self._thread = threading.Thread(target=self._run, name="dtrain-peak-memory", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def sample(self) -> None:
        """One reading of every tracked tree, folded into the peaks."""
        table = all_processes()
        with self._lock:
            roots = dict(self._roots)
        for name, pid in roots.items():
            now = tree_sample(pid, table)
            if now is None:
                continue
            with self._lock:
                peak = self._peaks.setdefault(name, {"pss": 0, "kinds": {}})
                peak["pss"] = max(peak["pss"], now["pss"])
                for kind, bucket in now["kinds"].items():
                    peak["kinds"][kind] = max(peak["kinds"].get(kind, 0), bucket["pss"])

    def peaks(self) -> dict[str, dict]:
        """name -> {"pss": the tree's peak total in bytes, "kinds": {kind: that kind's own peak}}."""
        with self._lock:
            return {name: {"pss": p["pss"], "kinds": dict(p["kinds"])} for name, p in self._peaks.items()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
