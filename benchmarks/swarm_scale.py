#!/usr/bin/env python3
"""Swarm scale: replicas in step, participation and loss per token as the sandbox swarm grows.

For each swarm size N (``--miners``, default 6 12 24) it runs the shipped path, ``dtrain
sandbox --miners N --check C --rounds R --mode M --json --dir D`` (one validator, honest
miners, each its own process on loopback), reads what the sandbox left in D, and trains a
single-process baseline in this process. ``--check C`` is the validator's miners checked per
round (``validator.miners_per_round``; the benchmark passes min(C, N)).

Figures, per run (rules):

* The timeline is the swarm's rounds, not only the validator's, so that a round some miners
  ran without the validator (they never should: they join only from a validator's notice or
  query, dtrain.neurons.round_joining) shows. A swarm round is every group some neuron's round record
  (``<D>/neurons/<name>/data/<role>-*/rounds.jsonl``) says averaged (ok), and every round the
  validator persisted (its state.json); oldest first, by the earliest record's start.
  ``swarm_rounds`` counts them, ``rounds_without_validator`` those the validator was not in.
* ``rounds_to_tolerance``: the first swarm round r (1-based) after which every miner was in
  step and stayed in step through the last round. A miner is in step after a round when its
  own record of that group (matched by ``round_id``) says SUCCESS, the round was ok and
  ``in_step`` (no part of the vector kept local values). Peers of another epoch are refused
  from a group, so every miner in step in one group means: one epoch, the same averaged bits
  applied. That is an inference: replicas that already differed at the same epoch (a fork: two
  groups averaged the same epoch apart) stay apart while looking in step, and a catch-up
  (``catch_ups``, from the neurons' logs) is not in any record. So the figure is reported only
  when the measured final distance below confirms it (else None, with the records' answer in
  ``rounds_to_tolerance_inferred``). ``rounds_all_in_step`` counts the rounds with every miner
  in step. From a fresh start the replicas are identical: the ideal is 1.
* ``final_max_distance``: measured. Every miner's last checkpoint (written when the sandbox
  stops it) is loaded into the sandbox's model, and the largest pairwise relative L2 distance
  of the parameters is taken (``dtrain.training.replica.params_distance``, both orders,
  ||a - b|| / ||b||: ``slice_distance`` over the whole vector, relative to the model's rms);
  ``final_within_tolerance``: ``replica.within_tolerance`` of it (REPLICA_RTOL) with no miner's
  checkpoint missing. ``final_max_distance_to_validator`` compares each miner with the
  validator's replica (what the validator's slice checks do); ``final_epochs`` are the
  checkpoints' epochs.
* ``participation``: over (miner, swarm round) pairs, the fraction where the miner's own record
  says SUCCESS (it was in that round's average); ``participation_validator_rounds`` the same
  over the validator's rounds only. ``ever_failed`` names every miner with a FAIL; ``outcomes``
  counts all outcomes (a miner with no record of a round gets the validator's record's outcome
  for it where that round averaged, else ABSENT). ``outcome_disagreements`` counts pairs where
  the validator's record of a round it averaged gives the miner another outcome than its own.
  ``contribution_counted``: SUCCESS does not mean the miner's work was averaged in. Every
  group member reduces one part of the vector with its own weight caps (a validator gives a
  miner it did not check weight 0), so over the same pairs this is the mean share of the
  round's ok records that gave the miner a weight above zero (0 when it was not SUCCESS): 1.0
  when every part averaged every miner's contribution.
* ``loss_ratio``: swarm_loss / single_loss. swarm_loss is the validator's held-out loss after
  its last round (the summary's ``loss.end``). single_loss: the same tiny model from the same
  init (``runtime.build_workbench`` with the sandbox's neuron config: run id, seed, shipped
  corpus and tokenizer), driven in one process by dtrain's own mode classes with the whole
  global batch, N x the sandbox's local batch per optimizer step (per-step mode; DiLoCo: per
  inner step, H inner steps, then the outer step), on the pages the N miners are assigned
  (``assign_pages`` for their uids and epochs), for as many optimizer steps as the validator's
  replica took (its final epoch: rounds without it count, through its catch-ups), and scored
  by the validator's own ``_eval_batch`` / ``_eval_loss`` on the same held-out batch.
  ``tokens_single`` = steps x N x local batch (x H) x seq_len. ``tokens_averaged``: what the
  swarm's groups averaged up to the validator's last round (each distinct ok round once, the
  mean of its records' ``total_weight`` x seq_len): lower when miners sat out or sent partial batches, which
  the ratio then shows; higher when a split swarm averaged the same epochs twice.
  ``validator_checkpoint_loss`` re-scores the validator's last checkpoint the same way (a
  cross-check of loss.end).
* ``round_period_s``: median time between the ends of consecutive validator rounds;
  ``allreduce_s``: median butterfly time; ``peak_pss_bytes``: the peak over samples (every
  ``--mem-interval`` s) of the summed Pss of the sandbox process, its descendants and the
  sessions they lead (neurons, hivemind workers, p2pd); 0 disables the sampler.

With ``--repeats K`` each size runs K sandboxes; each figure is the median over them with its
min and max. The baseline is deterministic and computed once per step count.

    python benchmarks/swarm_scale.py                          # 6, 12 and 24 miners, a table
    python benchmarks/swarm_scale.py --miners 3 4 --rounds 2 --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

DEFAULT_MINERS = (6, 12, 24)
# Outcome of a (miner, round) pair with no record from the miner and no mention in the validator's.
ABSENT = "ABSENT"
# The event a neuron logs when it adopted a peer's state (dtrain.neurons.base.NeuronBase._catch_up).
CAUGHT_UP = "caught up to epoch"
# Extra seconds the benchmark gives a sandbox beyond its own deadlines before stopping it.
STOP_GRACE_S = 120.0


# ----------------------------------------------------------------------------- pure helpers


def spread(values) -> dict | None:
    """Median, min and max of the numbers among ``values`` (None and NaN left out); None if none."""
    xs = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def rounds_to_tolerance(all_in_step: list[bool]) -> int | None:
    """The 1-based round after which every miner was in step and stayed so through the last
    round; None when the last round did not have every miner in step (or there was none)."""
    first = None
    for index in range(len(all_in_step), 0, -1):
        if not all_in_step[index - 1]:
            break
        first = index
    return first


def participation(rows: list[dict], miners: list[str]) -> dict:
    """SUCCESS fraction over (miner, round) pairs, the miners ever FAIL, and all outcome counts."""
    counts: dict[str, int] = {}
    failed = set()
    for row in rows:
        for name in miners:
            outcome = row["outcomes"].get(name, ABSENT)
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome == "FAIL":
                failed.add(name)
    pairs = len(rows) * len(miners)
    return {"participation": counts.get("SUCCESS", 0) / pairs if pairs else None,
            "ever_failed": sorted(failed, key=_name_order), "outcomes": dict(sorted(counts.items()))}


def _name_order(name: str) -> tuple:
    """miner2 before miner10."""
    digits = "".join(ch for ch in name if ch.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else -1)


def consecutive_gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


# ----------------------------------------------------------------------------- the shipped sandbox


def dtrain_command() -> list[str]:
    """dtrain as this interpreter runs it (the venv the benchmark runs in; what the sandbox uses too)."""
    return [sys.executable, "-m", "dtrain"]


def sandbox_command(miners: int, args, directory: Path) -> list[str]:
    return [*dtrain_command(), "sandbox", "--miners", str(miners), "--check", str(min(args.check, miners)),
            "--rounds", str(args.rounds),
            "--mode", args.mode, "--json", "--dir", str(directory)]


def default_timeout_s(miners: int, rounds: int) -> float:
    """A hang guard above the sandbox's own deadlines (start-up 240 s + 60 s per further miner,
    120 s + 240 s per round for the validator, 60 s to stop)."""
    return 240 + 60 * miners + 120 + 240 * rounds + 60 + STOP_GRACE_S


class TreeMemory(threading.Thread):
    """Peak summed Pss of process ``root``, its descendants and the sessions they lead, sampled
    every ``interval_s`` (VmRSS where smaps_rollup cannot be read)."""

    def __init__(self, root: int, interval_s: float):
        super().__init__(name="swarm-scale-memory", daemon=True)
        self.root, self.interval_s = root, interval_s
        self.peak_bytes, self.peak_processes, self.samples = 0, 0, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            pids = _tree_pids(self.root)
            total = sum(_pss_bytes(pid) for pid in pids)
            self.samples += 1
            if total > self.peak_bytes:
                self.peak_bytes, self.peak_processes = total, len(pids)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)


def _tree_pids(root: int) -> set[int]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                text = Path(f"/proc/{name}/stat").read_text()
                fields = text[text.rfind(")") + 2:].split()
                table[int(name)] = (int(fields[1]), int(fields[3]))  # ppid, session
            except (OSError, ValueError, IndexError):
                continue
    members, grew = {root}, True
    while grew:
        before = len(members)
        members |= {pid for pid, (ppid, sid) in table.items() if ppid in members or sid in members}
        grew = len(members) > before
    return {pid for pid in members if pid in table}


def _pss_bytes(pid: int) -> int:
    for path, key in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return 0


def run_sandbox(cmd: list[str], timeout_s: float, mem_interval_s: float, log_path: Path) -> dict:
    """Run one sandbox; its stderr goes to ``log_path``. Returns the exit code, the parsed
    summary (None if stdout held no JSON document), the wall time and the peak memory. On
    timeout it gets SIGTERM (the sandbox then stops every neuron) and, if need be, SIGKILL."""
    t0 = time.monotonic()
    with open(log_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        sampler = TreeMemory(proc.pid, mem_interval_s) if mem_interval_s > 0 else None
        if sampler:
            sampler.start()
        timed_out = False
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            stdout = _stop(proc)
        except KeyboardInterrupt:
            _stop(proc)  # the sandbox got the SIGINT too; let it stop its neurons first
            raise
        finally:
            if sampler:
                sampler.stop()
    try:
        summary = json.loads(stdout.decode("utf-8", "replace")) if stdout.strip() else None
    except ValueError:
        summary = None
    return {"returncode": proc.returncode, "timed_out": timed_out, "summary": summary,
            "wall_s": time.monotonic() - t0,
            "peak_pss_bytes": sampler.peak_bytes if sampler and sampler.samples else None,
            "peak_processes": sampler.peak_processes if sampler and sampler.samples else None,
            "memory_samples": sampler.samples if sampler else 0}


def _stop(proc: subprocess.Popen) -> bytes:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        stdout, _ = proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
    return stdout or b""


def stderr_tail(path: Path, lines: int = 5) -> list[str]:
    try:
        return [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:]
    except OSError:
        return []


# ----------------------------------------------------------------------------- what the sandbox left


def members_of(root: Path) -> list:
    from dtrain.sandbox import layout
    from dtrain.sandbox.layout import Member

    manifest = layout.read_manifest(root)
    if manifest is None:
        raise ValueError(f"no sandbox manifest in {root}")
    return [Member(**m) for m in manifest["members"]]


def data_dir(root: Path, member) -> Path | None:
    """The neuron's state directory (``<root>/neurons/<name>/data/<role>-<hotkey[:12]>``)."""
    from dtrain.sandbox import layout

    found = sorted((layout.neuron_dir(root, member.name) / "data").glob(f"{member.role}-*"))
    return found[0] if found else None


def read_json(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def neuron_records(root: Path, member) -> list:
    """The neuron's RoundRecords, oldest first (its rounds.jsonl)."""
    from dtrain.swarm.records import read_records

    folder = data_dir(root, member)
    return read_records(folder / "rounds.jsonl") if folder is not None else []


def peer_id_of(root: Path, member, records: list) -> str | None:
    """The neuron's swarm peer id: from its status.json, else from its own round records."""
    folder = data_dir(root, member)
    peer = read_json(folder / "status.json" if folder is not None else None).get("peer_id")
    return peer or (records[0].local_peer_id if records else None)


def miner_cell(own, peer_id: str | None, validator_record) -> dict:
    """One (miner, round): its outcome and whether it is in step after the round (rules in the
    module docstring). ``own``: the miner's record of the round, if it wrote one; the
    validator's record speaks for the group only where it averaged (ok)."""
    trusted = validator_record is not None and validator_record.ok and peer_id
    seen = validator_record.outcome_of(peer_id) if trusted else None
    if own is None:
        return {"outcome": seen.value if seen is not None else ABSENT, "in_step": False, "disagrees": False}
    mine = own.outcome_of(own.local_peer_id)
    outcome = mine.value if mine is not None else ABSENT
    in_step = outcome == "SUCCESS" and own.ok and own.in_step
    return {"outcome": outcome, "in_step": in_step, "disagrees": seen is not None and seen.value != outcome}


def swarm_rounds(records: dict[str, list], validator_rounds: list[dict]) -> list[str]:
    """The swarm's rounds, oldest first (by their earliest record's start): every group a record
    says averaged (ok), with the validator or without it, and every round the validator persisted.
    ``records``: neuron name -> its RoundRecords."""
    start: dict[str, float] = {}
    averaged = set()
    for recs in records.values():
        for rec in recs:
            if rec.round_id:
                start[rec.round_id] = min(start.get(rec.round_id, rec.started_at), rec.started_at)
                if rec.ok:
                    averaged.add(rec.round_id)
    keep = averaged | {vr.get("round_id") for vr in validator_rounds if vr.get("round_id")}
    return sorted(keep, key=lambda rid: start.get(rid, math.inf))


def round_table(order: list[str], records: dict[str, list], miners: dict[str, str | None], validator: str,
                validator_rounds: list[dict]) -> list[dict]:
    """A row per swarm round (``order``): every miner's outcome and in-step flag, and the
    validator's round number where it was one of the validator's. ``miners``: name -> peer id."""
    by_round = {name: {r.round_id: r for r in recs if r.round_id} for name, recs in records.items()}
    numbers = {vr.get("round_id"): vr.get("round") for vr in validator_rounds if vr.get("round_id")}
    rows = []
    for index, round_id in enumerate(order, 1):
        vrec = by_round.get(validator, {}).get(round_id)
        cells = {name: miner_cell(by_round.get(name, {}).get(round_id), peer, vrec) for name, peer in miners.items()}
        averaged = [recs[round_id] for recs in by_round.values() if round_id in recs and recs[round_id].ok]
        rows.append({"index": index, "round_id": round_id, "validator_round": numbers.get(round_id),
                     "outcomes": {n: c["outcome"] for n, c in cells.items()},
                     "counted": {n: counted_share(averaged, miners[n]) if c["outcome"] == "SUCCESS" else 0.0
                                 for n, c in cells.items()},
                     "all_in_step": bool(cells) and all(c["in_step"] for c in cells.values()),
                     "disagreements": sum(c["disagrees"] for c in cells.values())})
    return rows


def counted_share(averaged: list, peer_id: str | None) -> float:
    """The share of a round's ok records (one per group member: each reduces its part of the
    vector with its own weight caps) that gave ``peer_id`` a weight above zero."""
    seen = [r.result_of(peer_id) for r in averaged if peer_id]
    seen = [p for p in seen if p is not None]
    return sum(p.weight_used > 0 for p in seen) / len(seen) if seen else 0.0


def tokens_averaged(all_records: list, seq_len: int, until: float = math.inf) -> int:
    """Tokens the swarm's groups averaged in the rounds that started by ``until``: each distinct
    ok round once, the mean over its ok records of ``total_weight`` (the samples a reducer's part
    stands for, after its caps; reducers may differ) x seq_len."""
    weights: dict[str, list[float]] = {}
    for rec in all_records:
        if rec.ok and rec.round_id and rec.started_at <= until:
            weights.setdefault(rec.round_id, []).append(rec.total_weight)
    return round(sum(statistics.fmean(w) for w in weights.values()) * seq_len)


def last_start(records: list, round_id: str | None) -> float:
    """When round ``round_id`` started (its earliest record); inf when unknown."""
    starts = [r.started_at for r in records if round_id and r.round_id == round_id]
    return min(starts) if starts else math.inf


def catch_ups(root: Path, member) -> int:
    """How often the neuron adopted a peer's state (its log's "caught up to epoch" events)."""
    from dtrain.sandbox import layout

    try:
        return (layout.neuron_dir(root, member.name) / "log.txt").read_text(errors="replace").count(CAUGHT_UP)
    except OSError:
        return 0


# ----------------------------------------------------------------------------- model, replicas, eval


class _QuietTelemetry:
    def train_metrics(self, **_kw) -> None:
        pass


class EvalStandIn:
    """What ``Validator._eval_batch`` and ``Validator._eval_loss`` read of a validator, around a
    workbench: the baseline and the checkpoints are scored by the validator's own code."""

    def __init__(self, cfg, bench):
        self.cfg, self.bench, self.trainer = cfg, bench, bench.trainer
        self.epoch, self.dir, self.tel = 0, Path(tempfile.gettempdir()), _QuietTelemetry()
        self.eval_tokens = None

    def eval_loss(self) -> float:
        from dtrain.neurons.validator import Validator

        if self.eval_tokens is None:
            self.eval_tokens = Validator._eval_batch(self)
        return Validator._eval_loss(self)


def sandbox_config(mode: str, miners: int):
    """The config a sandbox miner runs with (``dtrain.sandbox.settings.neuron_config``); nothing
    is written: the paths in it are never opened here."""
    from dtrain.sandbox.layout import Member
    from dtrain.sandbox.settings import neuron_config

    member = Member(name="swarm-scale", role="miner", kind="honest", uid=1, hotkey="-" * 48)
    return neuron_config(Path(tempfile.gettempdir()) / "dtrain-swarm-scale-config", member, miners, 1, mode)


def open_workbench(cfg):
    from dtrain.neurons.runtime import build_workbench

    bench = build_workbench(cfg)
    bench.reader.open()
    return bench


def sandbox_shape(cfg) -> dict:
    """Per-miner batch, inner steps per round, sequence length and page size of the sandbox."""
    inner = cfg.allreduce.diloco_inner_steps if cfg.allreduce.mode == "diloco" else 1
    return {"local_batch": cfg.training.local_batch_size, "inner_steps": inner, "seq_len": cfg.model.seq_len,
            "page_sequences": cfg.data.page_sequences, "micro_batch": cfg.training.micro_batch_size}


def final_replicas(root: Path, members: list, mode: str) -> dict:
    """Load every neuron's last checkpoint into the sandbox's model: the largest pairwise
    distance between miners, the largest to the validator, their epochs, and the validator
    checkpoint's held-out loss."""
    from dtrain.training.checkpoint import CheckpointError, load_checkpoint
    from dtrain.training.replica import REPLICA_RTOL, params_distance, params_rms, within_tolerance

    miners = [m for m in members if m.role == "miner"]
    cfg = sandbox_config(mode, len(miners))
    bench = open_workbench(cfg)
    scorer = EvalStandIn(cfg, bench)
    flat, epochs, missing, validator_loss = {}, {}, [], None
    for m in members:
        folder = data_dir(root, m)
        try:
            if folder is None:
                raise CheckpointError(f"{m.name} left no state directory")
            state = load_checkpoint(folder / "checkpoints")
        except CheckpointError:  # never started, or unreadable: reported as missing
            missing.append(m.name)
            continue
        bench.model.load_state_dict(state["model"])
        flat[m.name] = _flat(bench.trainer.params)
        epochs[m.name] = int(state.get("epoch", -1))
        if m.role == "validator" and validator_loss is None:
            validator_loss = scorer.eval_loss()
    names = [m.name for m in miners if m.name in flat]
    pairwise = max((max(params_distance([flat[a]], [flat[b]]), params_distance([flat[b]], [flat[a]]))
                    for i, a in enumerate(names) for b in names[i + 1:]), default=None)
    vname = next((m.name for m in members if m.role == "validator" and m.name in flat), None)
    to_validator = (max((params_distance([flat[n]], [flat[vname]]) for n in names), default=None)
                    if vname else None)
    miners_missing = [m.name for m in miners if m.name not in flat]
    return {"final_max_distance": pairwise,
            "final_within_tolerance": (within_tolerance(pairwise) and not miners_missing
                                       if pairwise is not None else None),
            "final_max_distance_to_validator": to_validator,
            "params_rms": params_rms([flat[vname]]) if vname else None,
            "tolerance": REPLICA_RTOL, "final_epochs": epochs, "missing_checkpoints": missing,
            "validator_checkpoint_loss": validator_loss}


def _flat(params):
    import torch

    return torch.cat([p.detach().float().reshape(-1).cpu() for p in params]).clone()


# ----------------------------------------------------------------------------- single-process baseline


def single_process(mode: str, miner_uids: list[int], steps: int) -> dict:
    """The sandbox's model trained in one process on the N miners' pages, N x local batch per
    optimizer step, for ``steps`` steps, then scored on the validator's held-out batch."""
    from dtrain.swarm.records import RoundRecord
    from dtrain.training.data import assign_pages

    cfg = sandbox_config(mode, len(miner_uids))
    shape = sandbox_shape(cfg)
    cfg.training.local_batch_size = shape["local_batch"] * len(miner_uids)  # the global batch
    cfg.allreduce.target_batch_size = cfg.training.local_batch_size  # one step per global batch
    bench = open_workbench(cfg)
    mode_obj, reader = bench.mode, bench.reader
    pages_per_step = shape["local_batch"] // shape["page_sequences"]
    # A round of one peer: its own contribution is the average (dtrain.modes.base.Mode.apply_average).
    alone = RoundRecord(round_id="single-process", local_peer_id="single", started_at=0.0, duration_s=0.0,
                        fraction_averaged=1.0)
    t0 = time.monotonic()
    for epoch in range(steps):
        mode_obj.start_epoch(epoch)
        for k in range(shape["inner_steps"]):
            first = k * pages_per_step
            for uid in miner_uids:
                pages = assign_pages(run_id=bench.run_id, uid=uid, epoch=epoch, page_counter=first,
                                     count=pages_per_step, num_pages=reader.num_pages)
                for counter, page in enumerate(pages, first):
                    mode_obj.train_page(reader.read_pages([page]), page=page, counter=counter, epoch=epoch)
        if mode_obj.wants_data:
            raise RuntimeError(f"the baseline's {mode} mode wants more data after a full global batch")
        contribution = mode_obj.contribution(mode_obj.samples, math.inf)
        if mode_obj.apply_average(alone, contribution.tensors) is None:
            raise RuntimeError(f"the baseline's step {epoch + 1} did not apply (non-finite average)")
        bench.trainer.counters.epoch = epoch + 1
    loss = EvalStandIn(cfg, bench).eval_loss()
    tokens = steps * len(miner_uids) * shape["local_batch"] * shape["inner_steps"] * shape["seq_len"]
    return {"loss": loss, "steps": steps, "tokens": tokens, "seconds": time.monotonic() - t0}


# ----------------------------------------------------------------------------- one run, one size


def analyse(root: Path, summary: dict, mode: str) -> dict:
    """Every figure of one sandbox run from its directory and summary (rules: module docstring)."""
    members = members_of(root)
    miners = [m for m in members if m.role == "miner"]
    validator = next(m for m in members if m.role == "validator")
    vdir = data_dir(root, validator)
    vstate = read_json(vdir / "state.json" if vdir is not None else None)
    vrounds = [r for r in vstate.get("recent_rounds", []) if isinstance(r, dict)]
    records = {m.name: neuron_records(root, m) for m in members}
    peers = {m.name: peer_id_of(root, m, records[m.name]) for m in miners}
    rows = round_table(swarm_rounds(records, vrounds), records, peers, validator.name, vrounds)
    names = [m.name for m in miners]
    with_validator = [r for r in rows if r["validator_round"] is not None]
    shape = sandbox_shape(sandbox_config(mode, len(miners)))
    every = [rec for recs in records.values() for rec in recs]
    out = {"swarm_rounds": len(rows), "rounds_completed": len(vrounds),
           "rounds_ok": sum(r.get("status") == "success" for r in vrounds),
           "rounds_without_validator": len(rows) - len(with_validator),
           "rounds_to_tolerance": rounds_to_tolerance([r["all_in_step"] for r in rows]),
           "rounds_all_in_step": sum(r["all_in_step"] for r in rows),
           **participation(rows, names),
           "participation_validator_rounds": participation(with_validator, names)["participation"],
           "contribution_counted": (statistics.fmean(share for r in rows for share in r["counted"].values())
                                    if rows and names else None),
           "outcome_disagreements": sum(r["disagreements"] for r in rows),
           "tokens_averaged": tokens_averaged(every, shape["seq_len"],
                                              last_start(every, vrounds[-1].get("round_id") if vrounds else None)),
           "catch_ups": {m.name: catch_ups(root, m) for m in members},
           "swarm_loss": (summary.get("loss") or {}).get("end"),
           "loss_curve": (summary.get("loss") or {}).get("curve"),
           "round_period_s": spread(consecutive_gaps([r["time"] for r in vrounds if r.get("time")])),
           "allreduce_s": spread([r.get("allreduce_s") for r in vrounds]),
           "rounds": [{k: r[k] for k in ("index", "validator_round", "all_in_step", "outcomes")} for r in rows]}
    out.update(final_replicas(root, members, mode))
    out["swarm_steps"] = out["final_epochs"].get(validator.name)
    # The records cannot see replicas that already differed before a round (a fork: two groups
    # at the same epoch); the measured final distance can. Unconfirmed, the figure is withheld.
    out["rounds_to_tolerance_inferred"] = out["rounds_to_tolerance"]
    if out["final_within_tolerance"] is not True:
        out["rounds_to_tolerance"] = None
    out["miner_uids"] = sorted(m.uid for m in miners)
    return out


def run_size(miners: int, args, baselines: dict, notes: list[str]) -> list[dict]:
    """``--repeats`` sandboxes of ``miners`` miners, each analysed and set against the baseline."""
    runs = []
    for repeat in range(args.repeats):
        directory = Path(tempfile.mkdtemp(prefix=f"dtrain-swarm-scale-{miners}-"))
        root = directory / "sandbox"
        cmd = sandbox_command(miners, args, root)
        _progress(f"{miners} miners, run {repeat + 1}/{args.repeats}: {shlex.join(cmd)}")
        timeout = args.timeout or default_timeout_s(miners, args.rounds)
        res = run_sandbox(cmd, timeout, args.mem_interval, directory / "sandbox.stderr")
        run = {"miners": miners, "repeat": repeat + 1, "sandbox_command": shlex.join(cmd),
               "returncode": res["returncode"], "timed_out": res["timed_out"], "wall_s": res["wall_s"],
               "peak_pss_bytes": res["peak_pss_bytes"], "peak_processes": res["peak_processes"],
               "dir": str(root) if args.keep else None}
        if res["summary"] is None or not root.exists():
            run["error"] = "the sandbox printed no summary: " + " | ".join(stderr_tail(directory / "sandbox.stderr"))
        else:
            run["exit_codes"] = res["summary"].get("exit_codes")
            run["stop_notes"] = res["summary"].get("stop_notes") or {}
            try:
                run.update(analyse(root, res["summary"], args.mode))
                _add_baseline(run, args, baselines)
            except Exception as exc:  # noqa: BLE001 - one unreadable run must not lose the others
                run["error"] = f"analysis failed: {type(exc).__name__}: {exc}"
        if res["returncode"] != 0 and "error" not in run:
            run["error"] = (f"the sandbox exited with {res['returncode']}: "
                            + " | ".join(stderr_tail(directory / "sandbox.stderr")))
        if run.get("error"):
            notes.append(f"{miners} miners, run {repeat + 1}: {run['error']}")
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            notes.append(f"{miners} miners, run {repeat + 1}: state kept in {root}")
        runs.append(run)
    return runs


def _add_baseline(run: dict, args, baselines: dict) -> None:
    """The single-process loss for this run's step count (cached: it is deterministic) and the ratio."""
    steps = run.get("swarm_steps")
    if not steps or steps < 1:
        run["single_loss"] = run["loss_ratio"] = None
        return
    key = (run["miners"], steps)
    if key not in baselines:
        _progress(f"single-process baseline: {run['miners']} x local batch per step, {steps} steps")
        baselines[key] = single_process(args.mode, run["miner_uids"], steps)
    base = baselines[key]
    run.update(single_loss=base["loss"], tokens_single=base["tokens"], single_seconds=base["seconds"])
    swarm = run.get("swarm_loss")
    run["loss_ratio"] = swarm / base["loss"] if isinstance(swarm, (int, float)) and base["loss"] else None


FIGURES = ("rounds_to_tolerance", "rounds_to_tolerance_inferred", "rounds_all_in_step", "swarm_rounds",
           "rounds_without_validator", "rounds_completed", "final_max_distance", "final_max_distance_to_validator",
           "participation", "participation_validator_rounds", "contribution_counted", "outcome_disagreements",
           "swarm_loss", "single_loss", "loss_ratio", "validator_checkpoint_loss", "tokens_averaged",
           "tokens_single", "swarm_steps", "wall_s", "peak_pss_bytes")


def size_summary(runs: list[dict]) -> dict:
    """Each figure's median and spread over a size's runs, and what any run flagged."""
    out = {name: spread([r.get(name) for r in runs]) for name in FIGURES}
    out["round_period_s"] = spread([(r.get("round_period_s") or {}).get("median") for r in runs])
    out["allreduce_s"] = spread([(r.get("allreduce_s") or {}).get("median") for r in runs])
    out["final_within_tolerance"] = [r.get("final_within_tolerance") for r in runs]
    out["ever_failed"] = sorted({n for r in runs for n in r.get("ever_failed", [])}, key=_name_order)
    out["runs_ok"] = sum(1 for r in runs if not r.get("error"))
    return out


# ----------------------------------------------------------------------------- output


def _fmt(s: dict | None, fmt: str, scale: float = 1.0) -> str:
    """A figure's median, with [min-max] when the runs differ."""
    if s is None:
        return "-"
    text = format(s["median"] * scale, fmt)
    if s["min"] != s["max"]:
        text += f" [{format(s['min'] * scale, fmt)}-{format(s['max'] * scale, fmt)}]"
    return text


COLUMNS = (("miners", 6), ("to-tol", 7), ("in-step", 8), ("max-dist/tol", 12), ("particip", 9), ("counted", 8),
           ("FAIL", 5), ("swarm loss", 10), ("single", 8), ("ratio", 7), ("tok avg/single", 14), ("s/round", 8),
           ("peak Pss GiB", 12))
LEGEND = ("to-tol: rounds_to_tolerance (records' answer in parentheses when the final distance did not "
          "confirm it); in-step: swarm rounds with every miner in step / swarm rounds; max-dist/tol: largest "
          "pairwise distance of the miners' final replicas over the tolerance (<= 1: within it); particip: "
          "miner-rounds SUCCESS; counted: mean share of the reducers that gave the miner weight; ratio: swarm "
          "loss / single-process loss at the same steps and global batch; tok avg/single: tokens the groups "
          "averaged over the baseline's; per run: u = a round without the validator, vN = validator round N, "
          "+ = every miner in step after it")


def size_row(size: dict, tol: float) -> list[str]:
    """One size's cells, in COLUMNS order."""
    s = size["summary"]
    to_tol = _fmt(s["rounds_to_tolerance"], ".0f")
    if s["rounds_to_tolerance"] is None and s["rounds_to_tolerance_inferred"] is not None:
        to_tol = f"- ({_fmt(s['rounds_to_tolerance_inferred'], '.0f')})"
    toks = "-"
    if s["tokens_averaged"] and s["tokens_single"]:
        toks = f"{s['tokens_averaged']['median'] / s['tokens_single']['median']:.3f}"
    return [str(size["miners"]), to_tol, _fmt(s["rounds_all_in_step"], ".0f") + "/" + _fmt(s["swarm_rounds"], ".0f"),
            _fmt(s["final_max_distance"], ".2f", 1 / tol), _fmt(s["participation"], ".1%"),
            _fmt(s["contribution_counted"], ".1%"), str(len(s["ever_failed"])),
            _fmt(s["swarm_loss"], ".4f"), _fmt(s["single_loss"], ".4f"), _fmt(s["loss_ratio"], ".4f"), toks,
            _fmt(s["round_period_s"], ".1f"), _fmt(s["peak_pss_bytes"], ".2f", 1 / 2**30)]


def run_line(miners: int, run: dict) -> str | None:
    """One run's timeline, outcomes, final epochs and catch-ups."""
    rows = run.get("rounds") or []
    if not rows:
        return None
    timeline = " ".join((f"v{r['validator_round']}" if r["validator_round"] else "u")
                        + ("+" if r["all_in_step"] else "-") for r in rows)
    caught = {n: c for n, c in (run.get("catch_ups") or {}).items() if c}
    return (f"{miners} miners, run {run['repeat']}: {timeline}; outcomes {run.get('outcomes')}; final epochs "
            f"{run.get('final_epochs')}; catch-ups {caught or 'none'}")


def format_table(result: dict) -> str:
    """The human report: a row per size, then each run's timeline and the notes."""
    tol = result["tolerance"]
    setup = (f"dtrain sandbox, {result['mode']} mode, {result['rounds']} rounds, --check {result['check']} "
             f"({result['check_option']}), {result['repeats']} run(s) per size; replica tolerance {tol:.1e}; "
             "medians [min-max]")
    lines = [f"command: {result['command']}", setup, "", " ".join(f"{name:>{width}}" for name, width in COLUMNS)]
    for size in result["sizes"]:
        lines.append(" ".join(f"{cell:>{width}}" for cell, (_, width) in zip(size_row(size, tol), COLUMNS)))
    lines += ["", LEGEND]
    lines += [line for size in result["sizes"] for run in size["runs"] if (line := run_line(size["miners"], run))]
    lines += [f"note: {n}" for n in result["notes"]]
    lines.append(f"wall time {result['wall_seconds']:.0f} s")
    return "\n".join(lines)


def _progress(message: str) -> None:
    print(f"swarm_scale: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--miners", type=int, nargs="+", default=list(DEFAULT_MINERS), help="swarm sizes to run")
    ap.add_argument("--rounds", type=int, default=6, help="validator rounds per sandbox")
    ap.add_argument("--check", type=int, default=3,
                    help="miners the validator checks per round (dtrain sandbox --check; min(C, N) is passed)")
    ap.add_argument("--mode", choices=("gradient", "diloco"), default="gradient", help="allreduce.mode")
    ap.add_argument("--repeats", type=int, default=1, help="sandboxes per size (figures: median, min, max)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds one sandbox may run before it is stopped (default: above its own deadlines)")
    ap.add_argument("--mem-interval", type=float, default=5.0,
                    help="seconds between memory samples of the sandbox's processes (0: no sampling)")
    ap.add_argument("--keep", action="store_true", help="keep each sandbox's --dir (paths in the notes)")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.miners) < 2 or max(args.miners) > 32 or args.rounds < 1 or args.check < 1 or args.repeats < 1:
        raise SystemExit("--miners must be 2..32 (dtrain sandbox's range, and a swarm needs two), "
                         "--rounds, --check and --repeats >= 1")
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["swarm_scale.py", *argv])
    t0 = time.monotonic()
    notes: list[str] = []
    baselines: dict = {}
    sizes = []
    for n in args.miners:
        runs = run_size(n, args, baselines, notes)
        sizes.append({"miners": n, "check": min(args.check, n), "summary": size_summary(runs), "runs": runs})
    from dtrain.training.replica import REPLICA_RTOL

    result = {
        "benchmark": "swarm_scale", "command": command, "mode": args.mode, "rounds": args.rounds,
        "check": args.check, "repeats": args.repeats, "tolerance": REPLICA_RTOL,
        "sandbox": sandbox_shape(sandbox_config(args.mode, max(args.miners))),
        "baseline": "one process, dtrain's mode classes, N x local batch per optimizer step, the miners' pages, "
                    "the swarm's step count, the validator's held-out batch and eval code",
        "sizes": sizes, "notes": notes, "wall_seconds": time.monotonic() - t0,
    }
    if args.json:
        from dtrain import jsonutil

        print(jsonutil.dumps(result, indent=2, sort_keys=False))
    else:
        print(format_table(result))
    return 0 if all(s["summary"]["runs_ok"] == len(s["runs"]) for s in sizes) else 1


if __name__ == "__main__":
    sys.exit(main())
