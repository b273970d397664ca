"""The early group-formation rule (dtrain/swarm/averaging/assembly.py): a pure function of gathers."""

from __future__ import annotations

import math

from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given
from hypothesis import strategies as st

from dtrain.swarm.averaging.assembly import (
    EXPECT_KEY,
    MAX_EXPECTED,
    MemberClaim,
    claim_from_user_gather,
    expect_list,
    ready_to_assemble,
)

loads, dumps = MSGPackSerializer.loads, MSGPackSerializer.dumps


def miner(pid: str, w: float = 8.0, expect=None) -> MemberClaim:
    return MemberClaim(pid, w, None if expect is None else frozenset(expect))


def validator(pid: str, expect) -> MemberClaim:
    return MemberClaim(pid, 0.0, frozenset(expect))


def hivemind_gather(user) -> bytes:
    """What hivemind's averager.step puts on the wire: [bandwidth, mode, msgpack(user gather)]."""
    return dumps([None, 0, dumps(user)])


def test_forms_once_every_expected_peer_is_in():
    v = validator("V", {"m1", "m2"})
    assert not ready_to_assemble([v, miner("m1")], 2)
    assert ready_to_assemble([v, miner("m1"), miner("m2")], 2)
    # the validator may be the leader or a follower: order does not matter
    assert ready_to_assemble([miner("m2"), miner("m1"), v], 2)


def test_without_a_validator_list_the_window_decides():
    assert not ready_to_assemble([miner("m1"), miner("m2"), miner("m3")], 2)


def test_a_weighted_peer_list_constrains_but_never_triggers():
    # a miner naming only present peers cannot hurry a group with no validator in it
    assert not ready_to_assemble([miner("m1", expect={"m1", "m2"}), miner("m2")], 2)
    # and a miner naming an absent peer delays a group the validator would have formed
    v = validator("V", {"m1"})
    assert ready_to_assemble([v, miner("m1")], 2)
    assert not ready_to_assemble([v, miner("m1", expect={"ghost"})], 2)


def test_lists_of_several_validators_are_united():
    a, b = validator("A", {"m1", "m2"}), validator("B", {"m2", "m3"})
    assert not ready_to_assemble([a, b, miner("m1"), miner("m2")], 2)
    assert ready_to_assemble([a, b, miner("m1"), miner("m2"), miner("m3")], 2)


def test_min_group_size_still_holds():
    v = validator("V", {"m1"})
    assert not ready_to_assemble([v, miner("m1")], 3)
    assert ready_to_assemble([v, miner("m1"), miner("x")], 3)


def test_user_gather_parsing_refuses_malformed_values():
    good = claim_from_user_gather("p", {"w": 0.0, EXPECT_KEY: ["a", "b"]})
    assert good == MemberClaim("p", 0.0, frozenset({"a", "b"}))
    for bad in ([], "ab", [1, 2], ["a", ""], ["x" * 129], None, {"a": 1}, [["a"]], ["a"] * (MAX_EXPECTED + 1)):
        assert claim_from_user_gather("p", {"w": 0.0, EXPECT_KEY: bad}).expect is None, bad
    for w in (math.nan, math.inf, -1.0, "0", True, None):
        assert claim_from_user_gather("p", {"w": w, EXPECT_KEY: ["a"]}).weight is None, w
    assert claim_from_user_gather("p", ["not", "a", "dict"]) == MemberClaim("p", None, None)


def test_gather_bytes_of_any_shape_never_raise():
    """The wall decodes a member's gather for the rule (AveragerProcess._user_gather): whatever the
    bytes, the rule gets a claim, and bytes that are not dtrain's layout one with neither weight nor list."""
    from dtrain.swarm.hivemind_internals import AveragerProcess

    averager = object.__new__(AveragerProcess)  # the decoder only: no process, no DHT
    averager._parent_pid = None  # what hivemind's __del__ reads

    def claim(data):
        return claim_from_user_gather("p", averager._user_gather(data))

    assert claim(hivemind_gather({"w": 0.0, EXPECT_KEY: ["m"]})) == MemberClaim("p", 0.0, frozenset({"m"}))
    for junk in (b"", b"\xc1", b"\xff" * 7, dumps([1, 2]), dumps([None, 0, "str"]), dumps([None, 0, b"\xc1"]),
                 dumps({"a": 1}), dumps([None, 0, dumps([1, 2, 3])]), None, 12):
        assert claim(junk).expect is None and claim(junk).weight is None, junk


def test_expect_list_is_deterministic():
    assert expect_list(["b", "a", "b"]) == ["a", "b"]


names = st.sampled_from([f"p{i}" for i in range(6)])
claims = st.builds(MemberClaim, names, st.sampled_from([None, 0.0, 1.0, 5.0]),
                   st.none() | st.frozensets(names, min_size=1))


@given(st.lists(claims, max_size=6), st.integers(0, 6), names)
def test_naming_more_peers_never_hurries_a_group(members, index, extra):
    """The safety property behind forged lists: adding a name to anyone's list (or giving a
    listless member one) can only turn "form now" into "wait", never the other way round."""
    if not members:
        return
    i = index % len(members)
    m = members[i]
    if m.expect is None and m.weight == 0.0:
        return  # a validator naming its peers is the one thing meant to start a formation
    widened = MemberClaim(m.peer_id, m.weight, (m.expect or frozenset()) | {extra})
    changed = members[:i] + [widened] + members[i + 1:]
    if ready_to_assemble(changed, 2):
        assert ready_to_assemble(members, 2)


@given(st.lists(claims, max_size=6))
def test_forming_early_means_every_name_is_present(members):
    if ready_to_assemble(members, 2):
        present = {m.peer_id for m in members}
        for m in members:
            assert m.expect is None or m.expect <= present
        assert any(m.weight == 0.0 and m.expect for m in members)


def test_a_leader_leaves_out_followers_whose_wait_has_run_out():
    from dtrain.swarm.averaging.assembly import lapsed_followers

    # a follower gives up at its request's expiration + request_timeout (3 s here); the BEGIN
    # needs time on the wire, so half of that is the margin
    deadlines = {"early": 100.0, "late": 110.0}
    assert lapsed_followers(deadlines, now=100.0, request_timeout=3.0) == set()  # on time
    assert lapsed_followers(deadlines, now=101.4, request_timeout=3.0) == set()  # 1.6 s left
    assert lapsed_followers(deadlines, now=101.6, request_timeout=3.0) == {"early"}  # 1.4 s left: too late
    assert lapsed_followers(deadlines, now=120.0, request_timeout=3.0) == {"early", "late"}
    assert lapsed_followers({}, now=120.0, request_timeout=3.0) == set()
