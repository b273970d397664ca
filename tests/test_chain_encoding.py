"""dtrain's commitment through bittensor's real SCALE codec (``bittensor_core``).

No subtensor metadata is bundled with bittensor 11 or its dependencies (searched:
see docs/protocol.md, "Known unverified point"), so ``tests/subtensor_metadata.py``
writes the Commitments pallet's types from subtensor's source into a V14 metadata blob.
The SDK's Rust codec loads it and does all the encoding and decoding here: the
``set_commitment`` call composed by the SDK's ``submit_call`` path (through the
``substrate=`` seam), the call decoded back, and a ``CommitmentOf`` storage value
decoded into what the SDK's commitment reader turns back into dtrain's JSON.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

bt = pytest.importorskip("bittensor")
codec_module = pytest.importorskip("bittensor._transport.codec")

from dtrain.chain.bittensor_backend import BittensorChain, commitment_info  # noqa: E402
from dtrain.chain.commitment import (  # noqa: E402
    MAX_FIELDS,
    MAX_ONCHAIN_BYTES,
    CommitmentError,
    MinerCommitment,
    parse_commitment,
)
from dtrain.chain.retry import RetryPolicy  # noqa: E402
from tests import subtensor_metadata as md  # noqa: E402
from tests.test_chain_bittensor import NETUID, FakeSubstrate, _neuron, _wallet  # noqa: E402

PEER = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"  # a real-format Ed25519 peer id
REALISTIC = MinerCommitment(peer_id=PEER, api="203.0.113.7:8091", repo="hf://dtrain-miner/gpt2-250m")


LIVE_METADATA_ENV = "DTRAIN_SUBTENSOR_METADATA"


def _live_metadata() -> bytes:
    """The live runtime's metadata, when someone supplies it: the SDK's cache file
    (``~/.bittensor/runtime-cache/md1-*.bin``: ``STMD``, u32 transaction version, u8
    flag, then the metadata) or raw ``MetadataVersioned`` bytes."""
    path = os.environ.get(LIVE_METADATA_ENV)
    if not path:
        pytest.skip(f"no live subtensor metadata offline; set {LIVE_METADATA_ENV} to the SDK's "
                    "runtime-cache file to check against it (docs/protocol.md)")
    blob = Path(path).read_bytes()
    return blob[9:] if blob[:4] == b"STMD" else blob


@pytest.fixture(scope="module", params=["from-source", "live"])
def codec(request):
    metadata = md.build() if request.param == "from-source" else _live_metadata()
    return codec_module.RuntimeCodec(
        metadata, spec_version=md.SPEC_VERSION, transaction_version=md.TRANSACTION_VERSION
    )


def expected_call_bytes(netuid: int, text: str) -> bytes:
    """``set_commitment`` as subtensor's own ``Encode`` writes it (types.rs): pallet and
    call index, ``NetUid`` as u16 LE, a compact field count, then per field the byte
    ``len + 1`` followed by the raw bytes (no length prefix)."""
    data = text.encode()
    chunks = [data[i : i + 128] for i in range(0, len(data), 128)]
    out = bytes([md.COMMITMENTS_PALLET_INDEX, md.SET_COMMITMENT_CALL_INDEX])
    out += netuid.to_bytes(2, "little") + md.compact(len(chunks))
    for chunk in chunks:
        out += bytes([len(chunk) + 1]) + chunk
    return out


def test_the_metadata_is_what_the_sdk_codec_reads(codec):
    assert codec.constant("Commitments", "MaxFields") == MAX_FIELDS
    entry = codec.storage_entry("Commitments", "CommitmentOf")
    assert entry.param_hashers == ["Identity", "Twox64Concat"] and entry.modifier == "Optional"


@pytest.mark.parametrize("record", [
    REALISTIC,
    MinerCommitment(peer_id=PEER, api="[2001:db8::1]:8091", repo="hf://owner/" + "m" * 150),
    MinerCommitment(peer_id="QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", api="miner.example.org:443", repo="o/m"),
], ids=["realistic", "three-fields", "short"])
def test_commitment_call_encodes_like_the_runtime_and_decodes_back(codec, record):
    text = record.to_json()
    call = codec.compose_call("Commitments", "set_commitment", {"netuid": NETUID, "info": commitment_info(text)})
    assert call.data == expected_call_bytes(NETUID, text)
    decoded = codec.decode_call(call.data)
    assert (decoded["call_module"], decoded["call_function"]) == ("Commitments", "set_commitment")
    args = {arg["name"]: arg["value"] for arg in decoded["call_args"]}
    assert args["netuid"] == NETUID
    fields = args["info"]["fields"]
    assert 1 <= len(fields) <= MAX_FIELDS
    raw = b"".join(bytes.fromhex(value[2:]) for field in fields for value in field.values())
    assert parse_commitment(raw) == record


def test_realistic_commitment_fits_with_room_to_spare():
    # peer id + public IPv4 API + an hf:// repo: 134 bytes, two Raw fields of the three.
    text = REALISTIC.to_json()
    assert len(text.encode()) == 134
    assert [list(f) for f in commitment_info(text)["fields"]] == [["Raw128"], ["Raw6"]]
    # The longest repo dtrain accepts (200 chars) still fits beside a typical API address.
    longest_repo = MinerCommitment(peer_id=PEER, api="[2001:db8:85a3::8a2e:370:7334]:8091", repo="o/" + "m" * 198)
    assert len(longest_repo.to_json().encode()) <= MAX_ONCHAIN_BYTES


def test_size_limits_match_the_runtime(codec):
    # Exactly MaxFields full Raw128 fields: the most the chain takes.
    full = "x" * MAX_ONCHAIN_BYTES
    info = commitment_info(full)
    assert [list(f) for f in info["fields"]] == [["Raw128"]] * MAX_FIELDS
    codec.compose_call("Commitments", "set_commitment", {"netuid": NETUID, "info": info})
    # One byte more needs a fourth field: TooManyFieldsInCommitmentInfo on chain, refused here.
    with pytest.raises(CommitmentError, match="allows 3"):
        commitment_info(full + "x")
    # The codec itself has no Raw129: a field over 128 bytes cannot be encoded at all.
    with pytest.raises(Exception):
        codec.compose_call("Commitments", "set_commitment",
                           {"netuid": NETUID, "info": {"fields": [{"Raw129": "0x" + "78" * 129}]}})
    # A record whose fields are each valid but which is too long together is refused when made.
    with pytest.raises(CommitmentError, match="at most 3 fields of 128 bytes"):
        MinerCommitment(peer_id=PEER, api=".".join(["a" * 60] * 3) + ".example:1", repo="o/" + "m" * 190)


def test_codec_rejects_a_wrong_shape(codec):
    # What dtrain sends is checked, not coerced: a payload of the wrong length or a
    # misspelt variant is an error, so the test above is not passing vacuously.
    for info in ({"fields": [{"Raw5": "0x68656c6c"}]}, {"fields": [{"Raw": "0x68"}]}, {"field": []}):
        with pytest.raises(Exception):
            codec.compose_call("Commitments", "set_commitment", {"netuid": NETUID, "info": info})


class CodecSubstrate(FakeSubstrate):
    """The in-memory chain, but composing calls with the SDK's real codec, as the RPC
    backend does (``SubstrateConnection.compose_call`` → ``RuntimeCodec.compose_call``)."""

    def __init__(self, codec, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.codec = codec

    async def compose(self, call):
        module, function, params = call
        return self.codec.compose_call(module, function, params)


def test_commit_through_the_sdk_submit_path_with_the_real_codec(codec, tmp_path):
    miner = _wallet(tmp_path, "miner")
    hotkey = miner.hotkey.ss58_address
    fake = CodecSubstrate(codec, [_neuron(0, hotkey, miner.coldkeypub.ss58_address, 10**9, False)])
    fake.maps[("Commitments", "CommitmentOf", NETUID)] = []
    fake.maps[("Commitments", "RevealedCommitments", NETUID)] = []
    fake.maps[("SubtensorModule", "Uids", NETUID)] = [(hotkey, 0)]
    fast = RetryPolicy(attempts=2, base_delay=0.0, max_delay=0.0)
    chain = BittensorChain("finney", NETUID, wallet=miner, substrate=fake, read_retry=fast, write_retry=fast)
    try:
        assert chain.commit(REALISTIC) is True
        composed, signer = fake.submitted[-1]
        assert signer == hotkey
        assert isinstance(composed, codec_module.CallBytes)
        assert composed.data == expected_call_bytes(NETUID, REALISTIC.to_json())

        # What the chain would store, encoded and decoded by the same codec, read back
        # through the SDK's commitment reader into dtrain's parser.
        args = {a["name"]: a["value"] for a in codec.decode_call(composed.data)["call_args"]}
        entry = codec.storage_entry("Commitments", "CommitmentOf")
        stored = codec.encode(entry.value_type, {"deposit": 0, "block": 120, "info": args["info"]})
        value = codec.decode(entry.value_type, stored)
        fake.maps[("Commitments", "CommitmentOf", NETUID)] = [(hotkey, value)]
        fake.storage[("Commitments", "CommitmentOf", NETUID, hotkey)] = value
        assert chain.commitments() == {hotkey: REALISTIC}
        # ...and the unchanged record is not sent again.
        assert chain.commit(REALISTIC) is False and len(fake.submitted) == 1
    finally:
        chain.close()
