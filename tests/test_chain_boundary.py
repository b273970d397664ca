"""The chain boundary: programming errors vs outages, version_key, and the first message
a neuron prints when the chain cannot be reached.

Errors are raised by a substrate backend behind the SDK's own ``substrate=`` seam, so
the SDK's client, dtrain's translation and dtrain's retry layer are all real code.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

bt = pytest.importorskip("bittensor")

from websockets.exceptions import ConnectionClosedError  # noqa: E402

from dtrain.chain import sandbox  # noqa: E402
from dtrain.chain.base import (  # noqa: E402
    SPEC_VERSION,
    ChainClientBug,
    ChainError,
    ChainUnavailable,
    OutdatedValidator,
    choose_version_key,
    spec_version,
)
from dtrain.chain.bittensor_backend import BittensorChain  # noqa: E402
from dtrain.chain.retry import RetryPolicy  # noqa: E402
from dtrain.chain.sandbox import SandboxChain  # noqa: E402
from tests import test_chain_bittensor  # noqa: E402
from tests.test_chain_bittensor import NETUID, FakeSubstrate  # noqa: E402

world = test_chain_bittensor.world  # the in-memory chain fixture, shared

FAST = RetryPolicy(attempts=3, base_delay=0.0, max_delay=0.0)


class FailingSubstrate(FakeSubstrate):
    """Raises ``error`` from the next ``failures`` block-number reads."""

    def __init__(self, error: BaseException, failures: int = 1_000):
        super().__init__([])
        self.error, self.failures, self.calls = error, failures, 0

    async def block_number(self) -> int:
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise self.error
        return self.head


def _chain(substrate) -> BittensorChain:
    return BittensorChain("finney", NETUID, substrate=substrate, read_retry=FAST, write_retry=FAST)


# -- programming errors are bugs, not outages ------------------------------------------------


@pytest.mark.parametrize("error", [
    TypeError("block_number() got an unexpected keyword argument 'at'"),
    AttributeError("'NoneType' object has no attribute 'decode'"),
    NameError("name 'codec' is not defined"),
    AssertionError("bad state"),
    bt.ConnectionNotReady("Client connection is not open"),
], ids=lambda e: type(e).__name__)
def test_sdk_programming_error_is_a_bug_not_retried(error):
    fake = FailingSubstrate(error)
    chain = _chain(fake)
    try:
        with pytest.raises(ChainClientBug) as info:
            chain.block()
    finally:
        chain.close()
    assert fake.calls == 1  # not retried
    message = str(info.value)
    assert f"bittensor {bt.__version__}" in message and "Client.block" in message
    assert type(error).__name__ in message and "bug in dtrain" in message
    assert info.value.__cause__ is error  # the original, with its traceback
    # Not a ChainError, so nothing that rides out outages (catching ChainError) swallows it,
    # and the chain's health does not show an outage that did not happen.
    assert not isinstance(info.value, ChainError)
    assert chain.health.consecutive_failures == 0


@pytest.mark.parametrize("error", [
    ConnectionRefusedError(111, "Connection refused"),
    OSError(101, "Network is unreachable"),
    TimeoutError("timed out"),
    ConnectionClosedError(None, None),
    bt.RpcConnectionError("could not connect to any endpoint"),
], ids=lambda e: type(e).__name__)
def test_network_errors_are_retried_as_unavailable(error):
    fake = FailingSubstrate(error, failures=2)
    chain = _chain(fake)
    try:
        assert chain.block() == 100  # two failures, the third attempt answers
        assert fake.calls == 3 and chain.health.ok
        fake.failures = 10
        with pytest.raises(ChainUnavailable) as info:
            chain.block()
        assert isinstance(info.value.__cause__, type(error))
        assert chain.health.consecutive_failures == 3
    finally:
        chain.close()


def test_transport_request_exception_is_retried():
    from bittensor._transport.errors import MaxRetriesExceeded

    fake = FailingSubstrate(MaxRetriesExceeded("Max retries reached"), failures=1)
    chain = _chain(fake)
    try:
        assert chain.block() == 100 and fake.calls == 2
    finally:
        chain.close()


def test_sdk_refusal_is_a_chain_error_not_retried():
    fake = FailingSubstrate(bt.BittensorError("netuid 38 does not exist"))
    chain = _chain(fake)
    try:
        with pytest.raises(ChainError) as info:
            chain.block()
    finally:
        chain.close()
    assert not isinstance(info.value, ChainUnavailable) and fake.calls == 1


# -- version_key ---------------------------------------------------------------------------


def test_spec_version_grows_with_every_release():
    import dtrain

    assert SPEC_VERSION == spec_version(dtrain.__version__)
    assert spec_version("0.1.0") == 100
    assert spec_version("1.2.3") == 10203
    assert spec_version("2.10.0rc1") == 21000
    assert spec_version("3") == 30000
    # the subnet template's 1000/10/1 scheme gives 0.1.10 and 0.2.0 the same number
    releases = ["0.1.0", "0.1.9", "0.1.10", "0.2.0", "0.10.0", "0.99.99", "1.0.0"]
    assert [spec_version(v) for v in releases] == sorted({spec_version(v) for v in releases})
    assert choose_version_key(None) == SPEC_VERSION
    assert choose_version_key(0) == SPEC_VERSION
    assert choose_version_key(SPEC_VERSION) == SPEC_VERSION
    # the owner's gate is respected, never echoed: an outdated validator is told to upgrade
    with pytest.raises(OutdatedValidator, match="upgrade dtrain"):
        choose_version_key(SPEC_VERSION + 5)


def _sent_version_key(chain, fake) -> int:
    fake.head += 100  # past the rate limit
    chain.set_weights([0, 1], [0.5, 0.5])
    call, _ = fake.submitted[-1]
    return call.params["version_key"]


def test_set_weights_sends_dtrains_version_and_respects_the_subnets_gate(world):
    chain, fake, _, _ = world
    key = ("SubtensorModule", "WeightsVersionKey", NETUID)
    # Not readable (absent from this runtime's answer): dtrain's own spec version.
    assert _sent_version_key(chain, fake) == SPEC_VERSION
    # 0 (the check disabled) or at most ours: ours.
    fake.storage[key] = 0
    assert _sent_version_key(chain, fake) == SPEC_VERSION
    fake.storage[key] = SPEC_VERSION
    assert _sent_version_key(chain, fake) == SPEC_VERSION
    # The subnet requires a newer dtrain: nothing is submitted, and the error says to upgrade
    # (it is a ChainError the validator reports, not an outage to retry).
    fake.storage[key] = SPEC_VERSION + 4000
    sent = len(fake.submitted)
    fake.head += 100
    with pytest.raises(OutdatedValidator, match="upgrade dtrain"):
        chain.set_weights([0, 1], [0.5, 0.5])
    assert len(fake.submitted) == sent
    assert chain.weights_version() == SPEC_VERSION + 4000
    # An explicit key is sent as given.
    fake.storage[key] = 0
    fake.head += 100
    chain.set_weights([1], [1.0], version_key=7)
    assert fake.submitted[-1][0].params["version_key"] == 7


def test_sandbox_records_and_checks_the_version_key(tmp_path):
    sandbox.create(tmp_path, weights_rate_limit=0)
    admin = SandboxChain(tmp_path)
    validator_uid = admin.register("hk-v", stake=1000, validator_permit=True)
    admin.register("hk-m")
    validator = SandboxChain(tmp_path, hotkey="hk-v", retry=FAST)
    try:
        validator.set_weights([1], [1.0])
        assert validator.version_keys() == {validator_uid: SPEC_VERSION}
        admin.set_weights_version(SPEC_VERSION + 1000)
        assert admin.info()["weights_version"] == SPEC_VERSION + 1000
        with pytest.raises(OutdatedValidator, match="upgrade dtrain"):
            validator.set_weights([1], [1.0])
        # An older key sent explicitly is refused like subtensor's IncorrectWeightVersionKey,
        # and not retried; a new enough one is recorded.
        with pytest.raises(ChainError, match="IncorrectWeightVersionKey"):
            validator.set_weights([1], [1.0], version_key=SPEC_VERSION)
        assert validator.version_keys() == {validator_uid: SPEC_VERSION}
        validator.set_weights([1], [1.0], version_key=SPEC_VERSION + 1000)
        assert validator.version_keys() == {validator_uid: SPEC_VERSION + 1000}
    finally:
        validator.close()
        admin.close()


# -- the first message when the chain cannot be reached ------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Events:
    """Telemetry stand-in: keeps events and stops the wait after ``stop_after`` of them."""

    def __init__(self, stop: threading.Event, stop_after: int = 1):
        self.events: list[str] = []
        self.stop, self.stop_after = stop, stop_after

    def event(self, message: str, **_: object) -> None:
        self.events.append(message)
        if len(self.events) >= self.stop_after:
            self.stop.set()

    def health(self, *_: object, **__: object) -> None:
        pass


def _neuron(chain, network: str, hotkey: str, stop_after: int = 1):
    from dtrain.config import Config
    from dtrain.neurons.base import NeuronBase

    cfg = Config()
    cfg.chain.network = network
    cfg.chain.netuid = NETUID
    stop = threading.Event()
    events = _Events(stop, stop_after)
    neuron = NeuronBase(cfg, events, stop)
    neuron.chain, neuron.hotkey = chain, hotkey
    return neuron, events


def test_unreachable_chain_says_so_not_unregistered():
    url = f"ws://127.0.0.1:{_closed_port()}"
    chain = BittensorChain(url, NETUID, read_retry=RetryPolicy(attempts=1, base_delay=0.0, max_delay=0.0),
                           call_timeout=20)
    neuron, events = _neuron(chain, url, "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY")
    started = time.monotonic()
    try:
        assert neuron._wait_for_registration(need_permit=False) is None  # stopped after one message
    finally:
        chain.close()
    assert time.monotonic() - started < 15
    [message] = events.events
    assert message.startswith(f"cannot reach the chain at {url} (network {url}): ")
    assert "refused" in message.lower() or "connect" in message.lower()
    assert "--network" in message and "not registered" not in message


def test_not_registered_only_when_the_chain_answered(world):
    chain, fake, validator, _ = world
    # Registered: the uid, and nothing to say.
    neuron, events = _neuron(chain, "finney", validator.hotkey.ss58_address)
    assert neuron._wait_for_registration(need_permit=True) == 0 and events.events == []
    # The chain answered without this hotkey: now, and only now, "not registered".
    neuron, events = _neuron(chain, "finney", "5Stranger")
    assert neuron._wait_for_registration(need_permit=False) is None
    assert events.events[0].startswith("hotkey 5Stranger is not registered on netuid 38 (finney)")
    # An answered but empty subnet is a wrong netuid or network, said as such.
    fake.neurons = []
    neuron, events = _neuron(chain, "finney", "5Stranger")
    assert neuron._wait_for_registration(need_permit=False) is None
    assert "has no registered neurons" in events.events[0]


def test_a_bug_is_not_waited_out():
    fake = FakeSubstrate([])

    async def broken(*_a, **_k):
        raise AttributeError("'dict' object has no attribute 'uid'")

    fake.runtime_call = broken
    chain = _chain(fake)
    neuron, events = _neuron(chain, "finney", "5Someone")
    try:
        with pytest.raises(ChainClientBug, match="Client.neurons.all"):
            neuron._wait_for_registration(need_permit=False)
    finally:
        chain.close()
    assert events.events == []
