"""dtrain's own butterfly over a fixed group (dtrain/swarm/butterfly.py), with real peers:
every peer a real hivemind DHT with its own p2pd on loopback, talking dtrain's protocol."""

from __future__ import annotations

import pytest
import torch

from dtrain.swarm.butterfly import ButterflyService, Membership, MembershipError
from dtrain.swarm.codecs import part_codec
from dtrain.swarm.loopback import run_concurrently

PART = 1000  # values per part


@pytest.fixture
def four(four_peers):
    return four_peers


def vectors(n: int, num_parts: int, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(PART, generator=gen) for _ in range(num_parts)] for _ in range(n)]


def run_all(svcs, membership, parts, codec="none", who=None, **options):
    options = {"sender_timeout_s": 10.0, "reducer_timeout_s": 10.0, **options}
    who = range(len(svcs)) if who is None else who

    def one(i):
        return svcs[i].transport.run(svcs[i].run(membership, parts[i], part_codec(codec), **options), timeout_s=60)

    return dict(zip(who, run_concurrently([lambda i=i: one(i) for i in who], timeout_s=90)))


@pytest.mark.slow
def test_every_member_holds_the_same_weighted_mean_and_a_weight_0_member_receives_it(four):
    svcs = four
    peers = tuple(s.transport.peer_id for s in svcs)
    # member 3 is a validator: it sends nothing and reduces nothing, but receives every part
    membership = Membership("r1", peers, senders=(0, 1, 2), weights=(1.0, 2.0, 5.0), shares=(3, 2, 2, 0))
    parts = vectors(4, membership.num_parts)
    originals = [[p.clone() for p in member] for member in parts[:3]]
    expected = [(1 * originals[0][g] + 2 * originals[1][g] + 5 * originals[2][g]) / 8
                for g in range(membership.num_parts)]
    outcomes = run_all(svcs, membership, parts)
    for i in range(4):
        assert outcomes[i].banned == {} and outcomes[i].failed_reducers == {}
        assert outcomes[i].unaveraged_parts == set()
        for g in range(membership.num_parts):
            torch.testing.assert_close(parts[i][g], expected[g], rtol=1e-5, atol=1e-6)
            assert torch.equal(parts[i][g], parts[0][g])  # the same bits everywhere


@pytest.mark.slow
def test_with_the_8bit_wire_every_member_holds_the_same_bits(four):
    svcs = four[:3]
    peers = tuple(s.transport.peer_id for s in svcs)
    membership = Membership("r8", peers, senders=(0, 1, 2), weights=(1.0, 1.0, 1.0), shares=(2, 2, 2))
    parts = vectors(3, membership.num_parts, seed=1)
    mean = [sum(parts[i][g] for i in range(3)) / 3 for g in range(membership.num_parts)]
    outcomes = run_all(svcs, membership, parts, codec="8bit")
    assert all(o.failed_reducers == {} and o.banned == {} for o in outcomes.values())
    for g in range(membership.num_parts):
        assert torch.equal(parts[0][g], parts[1][g]) and torch.equal(parts[1][g], parts[2][g])
        # each leg of the wire within the codec's bound (docs/swarm.md, "Wire compression")
        assert float((parts[0][g] - mean[g]).norm() / mean[g].norm()) < 0.08


@pytest.mark.slow
def test_a_member_that_never_comes_is_left_out_and_its_share_keeps_local_values(four):
    svcs = four
    peers = tuple(s.transport.peer_id for s in svcs)
    membership = Membership("r-absent", peers, senders=(0, 1, 2, 3), weights=(1.0,) * 4, shares=(2, 2, 2, 2))
    parts = vectors(4, membership.num_parts, seed=2)
    originals = [[p.clone() for p in member] for member in parts]
    outcomes = run_all(svcs, membership, parts, who=[0, 1, 2], sender_timeout_s=3.0, reducer_timeout_s=5.0)
    absent_share = range(*membership.share_of(3))
    for i in (0, 1, 2):
        outcome = outcomes[i]
        assert set(outcome.failed_reducers) == {3}
        assert outcome.unaveraged_parts == set(absent_share)
        assert 3 in outcome.banned  # its own reducer left it out of its share
        for g in range(membership.num_parts):
            if g in absent_share:
                assert torch.equal(parts[i][g], originals[i][g])
            else:
                mean = sum(originals[m][g] for m in (0, 1, 2)) / 3
                torch.testing.assert_close(parts[i][g], mean, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_centered_clip_bounds_an_outlier_and_every_member_still_holds_the_same_bits(four):
    peers = tuple(s.transport.peer_id for s in four)
    membership = Membership("r-clip", peers, senders=(0, 1, 2, 3), weights=(1.0,) * 4, shares=(1, 1, 1, 1))
    parts = vectors(4, membership.num_parts, seed=3)
    honest = [sum(parts[i][g] for i in range(3)) / 3 for g in range(4)]
    parts[3] = [p * 1000 for p in parts[3]]  # one sender 1000 times out of scale
    outcomes = run_all(four, membership, parts, robust=True)
    assert all(o.failed_reducers == {} for o in outcomes.values())
    for g in range(4):
        assert all(torch.equal(parts[i][g], parts[0][g]) for i in range(4))
        # the weighted mean would be about 250 times the honest mean; CenteredClip stays near it
        assert float((parts[0][g] - honest[g]).norm() / honest[g].norm()) < 2.0


def test_a_membership_that_breaks_its_rules_is_refused():
    with pytest.raises(MembershipError, match="distinct members"):
        Membership("r", ("a", "a"), senders=(0,), weights=(1.0,), shares=(1, 1))
    with pytest.raises(MembershipError, match="one finite weight"):
        Membership("r", ("a", "b"), senders=(0, 1), weights=(1.0,), shares=(1, 1))
    with pytest.raises(MembershipError, match="one finite weight"):
        Membership("r", ("a", "b"), senders=(0, 1), weights=(1.0, float("nan")), shares=(1, 1))
    with pytest.raises(MembershipError, match="distinct members"):
        Membership("r", ("a", "b"), senders=(0, 2), weights=(1.0, 1.0), shares=(1, 1))
    m = Membership("r", ("a", "b", "c"), senders=(0, 2), weights=(1.0, 1.0), shares=(2, 0, 3))
    assert m.num_parts == 5 and m.share_of(2) == (2, 5) and m.sender_index(2) == 1 and m.sender_index(1) is None


@pytest.mark.parametrize("name", ["none", "fp16", "8bit", "ternary"])
def test_part_codecs_round_trip_and_refuse_bytes_of_another_length(name):
    codec = part_codec(name)
    part = torch.randn(777)
    wire = codec.encode(part)
    decoded = codec.decode(wire, 777)
    assert decoded.shape == (777,) and decoded.dtype == torch.float32
    assert torch.equal(codec.decode(codec.encode(part), 777), decoded)  # deterministic
    with pytest.raises(ValueError):
        codec.decode(wire[:-1], 777)
    with pytest.raises(ValueError, match="hivemind's codec"):
        part_codec("8bit-uniform")


@pytest.mark.slow
def test_a_second_stream_of_the_same_member_is_refused_and_its_parts_count_once(four):
    import asyncio
    import contextlib
    import struct

    import msgpack

    from dtrain.swarm.butterfly import AVERAGE, OPEN, PART, PROTOCOL, REFUSED
    from dtrain.swarm.transport import read_frame, write_frame

    reducer, member = four[0], four[1]
    membership = Membership("r-twice", (reducer.transport.peer_id, member.transport.peer_id), senders=(0, 1),
                            weights=(1.0, 1.0), shares=(1, 0))
    ours, theirs = torch.ones(PART), torch.full((PART,), 3.0)
    codec = part_codec("none")

    async def member_side():
        async def stream():
            reader, writer = await member.transport.open(reducer.transport.peer_id, PROTOCOL)
            await write_frame(writer, OPEN, msgpack.packb({"r": "r-twice", "m": 1}))
            return reader, writer

        reader, writer = await stream()
        await write_frame(writer, PART, struct.pack("<I", 0) + codec.encode(theirs))
        first = await asyncio.wait_for(read_frame(reader), 10)  # the average, from the one stream served
        reader2, writer2 = await stream()
        with contextlib.suppress(ConnectionError):  # the reducer may have closed it already
            await write_frame(writer2, PART, struct.pack("<I", 0) + codec.encode(theirs))
        second = await asyncio.wait_for(read_frame(reader2), 10)
        writer.close()
        writer2.close()
        return second, first

    running = reducer.transport.submit(reducer.run(membership, [ours], codec, sender_timeout_s=5, reducer_timeout_s=5))
    second, first = member.transport.run(member_side(), timeout_s=30)
    outcome = running.result(timeout=30)
    assert second.kind == REFUSED and b"already has a stream" in second.payload
    assert first.kind == AVERAGE and outcome.banned == {}
    assert torch.equal(ours, torch.full((PART,), 2.0))  # (1 + 3) / 2: the member's part counted once


class _Tagged:
    """Round checks that tag what they send and refuse what carries a chosen tag: the
    butterfly's plumbing of heads, notes and verdicts, seen from every member."""

    def __init__(self, me, refuse_head=b"", bad_note_of=None):
        from dtrain.swarm.butterfly import RoundChecks

        self.me, self.refuse_head, self.bad_note_of = me, refuse_head, bad_note_of
        self.heads, self.reply_heads = {}, {}
        outer = self

        class Checks(RoundChecks):
            def head_for(self, reducer):
                return f"head-of-{outer.me}".encode()

            def accept_head(self, sender, head):
                outer.heads[sender] = head
                return "its head is refused" if head == outer.refuse_head else ""

            def reply_head(self):
                return f"reply-of-{outer.me}".encode()

            def note(self, j, account):
                return b"bad" if (outer.me, j) == outer.bad_note_of else f"note-{j}".encode()

            def read_reply_head(self, reducer, head):
                outer.reply_heads[reducer] = head
                return ""

            def check(self, reducer, j, part, note):
                return "its note is bad" if note == b"bad" else ""

        self.checks = Checks()


@pytest.mark.slow
def test_heads_and_notes_travel_and_the_checks_verdicts_leave_out_a_sender_and_zero_a_reducer(four):
    peers = tuple(s.transport.peer_id for s in four)
    membership = Membership("r-checks", peers, senders=(0, 1, 2, 3), weights=(1.0,) * 4, shares=(2, 2, 2, 0))
    parts = vectors(4, membership.num_parts, seed=4)
    originals = [[p.clone() for p in member] for member in parts]
    # every member refuses member 3's head; member 1's note of its second part is refused by all
    tagged = [_Tagged(i, refuse_head=b"head-of-3", bad_note_of=(1, 1)) for i in range(4)]

    def one(i):
        svc = four[i]
        return svc.transport.run(svc.run(membership, parts[i], part_codec("none"), sender_timeout_s=10,
                                         reducer_timeout_s=10, checks=tagged[i].checks), timeout_s=60)

    outcomes = run_concurrently([lambda i=i: one(i) for i in range(4)], timeout_s=90)
    for i, outcome in enumerate(outcomes):
        reducers = [k for k in range(3) if k != i]
        assert {k: tagged[i].reply_heads[k] for k in reducers} == {k: f"reply-of-{k}".encode() for k in reducers}
        if i < 3:
            assert outcome.banned == {3: "its head is refused"}
            # every sender's head, its own too (judged as any reducer judges it)
            assert tagged[i].heads == {s: f"head-of-{s}".encode() for s in range(4)}
        assert set(outcome.refused_reducers) == ({1} if i != 1 else set())
        assert outcome.zeroed_parts == ({3} if i != 1 else set())
        for g in range(membership.num_parts):
            if g == 3 and i != 1:
                assert torch.equal(parts[i][g], torch.zeros(PART))  # the refused reducer's rest: zeros
            else:
                mean = sum(originals[m][g] for m in range(3)) / 3  # member 3's contribution left out
                torch.testing.assert_close(parts[i][g], mean, rtol=1e-5, atol=1e-6)
