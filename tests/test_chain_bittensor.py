"""The bittensor backend, driven through the SDK's own seam: ``Client(substrate=...)``.

``FakeSubstrate`` implements the ``bittensor.Substrate`` calls the SDK's reads
and executor make for what dtrain uses, answering from plain dicts with the
decoded shapes the real RPC backend returns. Everything above it -- the SDK's
read functions (neurons, commitments, weights, hyperparameters), the
``SetWeights`` intent's preflight/conform/compose, ``submit_call``, and all of
dtrain's BittensorChain -- is real code.
"""

from __future__ import annotations

import json

import pytest

bt = pytest.importorskip("bittensor")

from dtrain.chain.base import ChainUnavailable, NotRegistered, RateLimited  # noqa: E402
from dtrain.chain.bittensor_backend import BittensorChain, commitment_info  # noqa: E402
from dtrain.chain.commitment import MinerCommitment  # noqa: E402
from dtrain.chain.factory import open_chain  # noqa: E402
from dtrain.chain.retry import RetryPolicy  # noqa: E402

NETUID = 38
PEER = "12D3KooWabcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTU"


def _raw_fields(text: str) -> dict:
    return {"block": 90, "deposit": 0, "info": commitment_info(text)}


class FakeSubstrate:
    """In-memory chain state behind the SDK's Substrate protocol."""

    def __init__(self, neurons: list[dict], *, block: int = 100):
        self.token_symbols: dict[int, str] = {}
        self.head = block
        self.neurons = neurons
        self.storage: dict[tuple, object] = {}
        self.maps: dict[tuple, list] = {}
        self.submitted: list = []
        self.fail_connect = 0
        self.fail_submit = 0
        self.connects = 0

    # lifecycle
    def balance(self, rao: int, netuid: int = 0):
        return bt.Balance.from_rao(rao) if netuid == 0 else bt.Balance.from_rao(rao, netuid)

    async def connect(self) -> None:
        self.connects += 1
        if self.fail_connect:
            self.fail_connect -= 1
            raise bt.RpcConnectionError("could not connect to any endpoint")

    async def close(self) -> None:
        pass

    # reads
    async def block_number(self) -> int:
        return self.head

    async def finalized_block_number(self) -> int:
        return self.head

    async def block_hash(self, block=None) -> str:
        return f"0x{(self.head if block is None else block):064x}"

    async def block_time(self) -> float:
        return 12.0

    async def query(self, module, storage_function, params=None, block_hash=None):
        return self.storage.get((module, storage_function, *(params or [])))

    async def query_map(self, module, storage_function, params=None, block_hash=None):
        key = (module, storage_function, *(params or []))
        if key not in self.maps:
            raise bt.ChainError(f"fake has no map {key}")
        return list(self.maps[key])

    async def runtime_call(self, api, method, params, block_hash=None):
        if (api, method) == ("NeuronInfoRuntimeApi", "get_neurons_lite") and params == [NETUID]:
            return self.neurons
        raise bt.ChainError(f"fake has no runtime call {api}.{method}")

    # writes
    async def compose(self, call):
        return call

    async def estimate_fee(self, call, keypair):
        return bt.Balance.from_rao(1000)

    async def submit(self, call, keypair, **kwargs):
        if self.fail_submit:
            self.fail_submit -= 1
            raise bt.RpcConnectionError("connection dropped")
        self.submitted.append((call, keypair.ss58_address))
        return bt.ExtrinsicResult(success=True, message="ok")


def _wallet(tmp_path, name):
    wallet = bt.Wallet(name, "hot", path=str(tmp_path / "wallets"))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    wallet.create_new_hotkey(use_password=False, suppress=True)
    return wallet


def _neuron(uid, hotkey, coldkey, stake_rao, permit, last_update=0):
    return {
        "uid": uid, "hotkey": hotkey, "coldkey": coldkey, "active": True,
        "validator_permit": permit, "last_update": last_update,
        "stake": [(coldkey, stake_rao)],
    }


@pytest.fixture
def world(tmp_path):
    validator = _wallet(tmp_path, "val")
    miner = _wallet(tmp_path, "miner")
    v_hot, m_hot = validator.hotkey.ss58_address, miner.hotkey.ss58_address
    fake = FakeSubstrate([
        _neuron(0, v_hot, validator.coldkeypub.ss58_address, 5_000 * 10**9, True),
        _neuron(1, m_hot, miner.coldkeypub.ss58_address, 10**9, False),
    ])
    good = MinerCommitment(peer_id=PEER, api="10.0.0.2:8091", repo="owner/model").to_json()
    fake.maps[("Commitments", "CommitmentOf", NETUID)] = [
        (m_hot, _raw_fields(good)),
        (v_hot, _raw_fields("__import__('os').system('echo pwned')")),
    ]
    fake.maps[("Commitments", "RevealedCommitments", NETUID)] = []
    fake.maps[("SubtensorModule", "Uids", NETUID)] = [(v_hot, 0), (m_hot, 1)]
    fake.maps[("SubtensorModule", "Weights", NETUID)] = [(0, [(1, 65535)])]
    s = fake.storage
    s[("SubtensorModule", "Uids", NETUID, v_hot)] = 0
    s[("SubtensorModule", "Uids", NETUID, m_hot)] = 1
    s[("SubtensorModule", "WeightsSetRateLimit", NETUID)] = 10
    s[("SubtensorModule", "LastUpdate", NETUID)] = [95, 0]
    s[("SubtensorModule", "CommitRevealWeightsEnabled", NETUID)] = False
    s[("SubtensorModule", "MinAllowedWeights", NETUID)] = 1
    s[("SubtensorModule", "MaxWeightsLimit", NETUID)] = 65535
    fast = RetryPolicy(attempts=3, base_delay=0.0, max_delay=0.0)
    chain = BittensorChain("finney", NETUID, wallet=validator, substrate=fake,
                           read_retry=fast, write_retry=fast, call_timeout=30)
    yield chain, fake, validator, miner
    chain.close()


def test_reads_map_sdk_types(world, caplog):
    chain, fake, validator, miner = world
    assert chain.network == "finney"
    assert chain.block() == 100
    neurons = chain.neurons()
    assert [n.uid for n in neurons] == [0, 1]
    assert neurons[0].hotkey == validator.hotkey.ss58_address
    assert neurons[0].coldkey == validator.coldkeypub.ss58_address
    assert neurons[0].validator_permit and not neurons[1].validator_permit
    assert neurons[0].stake == pytest.approx(5000.0)
    with caplog.at_level("WARNING", logger="dtrain.chain"):
        commitments = chain.commitments()
    # The hostile one is data that fails validation, logged and skipped.
    assert list(commitments) == [miner.hotkey.ss58_address]
    assert commitments[miner.hotkey.ss58_address].api == "10.0.0.2:8091"
    assert "malformed commitment" in caplog.text
    assert chain.weights() == {0: {1: 1.0}}
    status = chain.weights_status()
    assert (status.block, status.rate_limit, status.last_set_block) == (100, 10, 95)
    assert status.blocks_until_allowed == 5
    assert chain.health.ok and chain.health.last_ok is not None


def test_set_weights_goes_through_sdk_intent(world):
    chain, fake, validator, _ = world
    fake.head = 200  # past the rate limit
    chain.set_weights([0, 1], [0.25, 0.75])
    call, signer = fake.submitted[-1]
    assert signer == validator.hotkey.ss58_address  # signed by the hotkey
    assert (call.module, call.function) == ("SubtensorModule", "set_mechanism_weights")
    assert call.params["netuid"] == NETUID and call.params["dests"] == [0, 1]
    # The SDK quantises to u16 with the max at 65535.
    assert call.params["weights"][1] == 65535 and 0 < call.params["weights"][0] < 65535


def test_set_weights_rate_limited_by_sdk_preflight(world):
    chain, fake, _, _ = world
    with pytest.raises(RateLimited):
        chain.set_weights([1], [1.0])  # last update 95, limit 10, head 100
    assert fake.submitted == []


def test_set_weights_retries_dropped_connection(world):
    chain, fake, _, _ = world
    fake.head = 200
    fake.fail_submit = 2
    chain.set_weights([1], [1.0])
    assert len(fake.submitted) == 1
    assert chain.health.ok
    assert "connection dropped" in chain.health.last_error  # the outage was seen


def test_set_weights_gives_up_after_bounded_retries(world):
    chain, fake, _, _ = world
    fake.head = 200
    fake.fail_submit = 10
    with pytest.raises(ChainUnavailable):
        chain.set_weights([1], [1.0])
    assert fake.fail_submit == 7  # exactly 3 attempts
    assert not chain.health.ok and chain.health.consecutive_failures == 3


def test_unregistered_hotkey_is_not_retried(world, tmp_path):
    chain, fake, _, _ = world
    stranger = _wallet(tmp_path, "stranger")
    chain.wallet = stranger
    fake.head = 200
    with pytest.raises(NotRegistered):
        chain.set_weights([1], [1.0])
    assert fake.submitted == []


def test_commit_submits_raw_fields_signed_by_hotkey(world):
    chain, fake, validator, _ = world
    record = MinerCommitment(peer_id=PEER, api="[2001:db8::1]:8091", repo="hf://owner/" + "m" * 150)
    assert chain.commit(record) is True
    call, signer = fake.submitted[-1]
    assert signer == validator.hotkey.ss58_address
    assert (call.module, call.function) == ("Commitments", "set_commitment")
    fields = call.params["info"]["fields"]
    assert len(fields) > 1 and all(len(bytes.fromhex(next(iter(f.values()))[2:])) <= 128 for f in fields)
    # What we wrote reads back through the SDK decoder as the same record.
    fake.maps[("Commitments", "CommitmentOf", NETUID)] = [
        (validator.hotkey.ss58_address, {"block": 100, "deposit": 0, "info": call.params["info"]})
    ]
    assert chain.commitments()[validator.hotkey.ss58_address] == record
    # Re-committing what the chain already holds sends no extrinsic (fees, space limit).
    fake.storage[("Commitments", "CommitmentOf", NETUID, validator.hotkey.ss58_address)] = {
        "block": 100, "deposit": 0, "info": call.params["info"]}
    sent = len(fake.submitted)
    assert chain.commit(record) is False and len(fake.submitted) == sent
    moved = MinerCommitment(peer_id=PEER, api="10.9.9.9:1", repo="o/m")
    assert chain.commit(moved) is True and len(fake.submitted) == sent + 1


def test_backend_satisfies_chain_protocol_and_permits(world):
    from dtrain.chain.base import Chain
    from dtrain.chain.permits import ValidatorPermits

    chain, fake, validator, miner = world
    assert isinstance(chain, Chain)
    permits = ValidatorPermits(chain, min_stake=1000.0)
    assert permits(validator.hotkey.ss58_address) and not permits(miner.hotkey.ss58_address)


def test_unreachable_chain_reports_health(world):
    chain, fake, _, _ = world
    fake.fail_connect = 5
    with pytest.raises(ChainUnavailable, match="could not connect"):
        chain.block()
    snap = chain.health.snapshot()
    assert snap["ok"] is False and snap["consecutive_failures"] == 3
    assert "could not connect" in snap["last_error"]
    # The caller keeps going; once the chain is back, health recovers.
    fake.fail_connect = 0
    assert chain.block() == 100
    assert chain.health.ok


def test_factory_picks_bittensor_for_urls_and_names(tmp_path):
    fake = FakeSubstrate([])
    for network in ("finney", "test", "local", "ws://127.0.0.1:9944", "wss://example.invalid:443"):
        chain = open_chain(network, NETUID, substrate=fake)
        try:
            assert isinstance(chain, BittensorChain)
        finally:
            chain.close()
    assert json.loads(json.dumps(commitment_info("x")))  # JSON-safe shape
