"""The real chain: bittensor 11's async ``Client`` behind the synchronous ``Chain``.

The SDK is asyncio-only while the core calls the chain from plain threads, so
this backend owns one private event loop in a daemon thread and submits each
call to it with a timeout. ``substrate=`` is passed straight to
``bittensor.Client`` -- the SDK's own injection seam -- so tests can drive the
whole backend with an in-memory chain.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Awaitable, Callable, Optional, Sequence

from dtrain import __version__ as DTRAIN_VERSION
from dtrain.chain.base import (
    SPEC_VERSION,
    ChainClientBug,
    ChainError,
    ChainHealth,
    ChainUnavailable,
    Neuron,
    NotPermitted,
    NotRegistered,
    RateLimited,
    WeightsStatus,
    choose_version_key,
)
from dtrain.chain.commitment import (
    MAX_FIELDS,
    MAX_ONCHAIN_BYTES,
    RAW_FIELD_BYTES,
    CommitmentError,
    MinerCommitment,
    parse_commitments,
)
from dtrain.chain.retry import RetryPolicy, retry_call

log = logging.getLogger("dtrain.chain")

# Raised from inside an SDK call, these mean the call is wrong (dtrain passed something
# the SDK does not take, or the SDK's own code is broken or of another version), never
# that the network failed: retrying cannot help and would hide the bug behind
# "chain unavailable". NameError covers UnboundLocalError; UnitMismatchError (mixing
# TAO and alpha balances) is a TypeError.
PROGRAMMING_ERRORS: tuple[type[BaseException], ...] = (
    TypeError,
    AttributeError,
    NameError,
    AssertionError,
    NotImplementedError,
    ImportError,
)


def _network_errors(bt: Any) -> tuple[type[BaseException], ...]:
    """Exception types that mean "the chain could not be reached": worth retrying.

    The SDK maps most transport failures to ``RpcConnectionError``; the rest can still
    escape raw (a connection closed mid-read, a request error from the transport), so
    they are listed too. Looked up lazily so a missing private module only narrows the
    list instead of breaking the backend.
    """
    found: list[type[BaseException]] = [bt.RpcConnectionError, ConnectionError, OSError, TimeoutError]
    try:
        from websockets.exceptions import WebSocketException

        found.append(WebSocketException)
    except ImportError:  # pragma: no cover - websockets is a hard dependency of bittensor 11
        pass
    try:
        # Raw transport error (JSON-RPC failure, retries exhausted, state pruned). The SDK
        # turns most of them into ChainError/RpcConnectionError; one that escapes is a
        # request that did not get a usable answer.
        from bittensor._transport.errors import SubstrateRequestException

        found.append(SubstrateRequestException)
    except ImportError:  # pragma: no cover - private module moved in another SDK version
        pass
    return tuple(found)


def bittensor_version(bt: Any) -> str:
    return str(getattr(bt, "__version__", "unknown"))


def commitment_info(text: str) -> dict:
    """``CommitmentInfo`` for ``set_commitment``: the UTF-8 text split into
    ``Raw<N>`` fields of <= 128 bytes, in order (readers concatenate Raw fields).

    The shape is what bittensor's codec takes for the pallet's ``Data`` enum (a
    one-key dict per variant, the ``[u8; N]`` payload as 0x-hex) and what the SDK
    decodes from ``CommitmentOf``, so a record round-trips through the SDK reader;
    tests/test_chain_encoding.py checks the bytes with the SDK's SCALE encoder.
    Raises :class:`CommitmentError` when the text needs more fields than the chain
    allows (``TooManyFieldsInCommitmentInfo`` on chain).
    """
    data = text.encode("utf-8")
    chunks = [data[i : i + RAW_FIELD_BYTES] for i in range(0, len(data), RAW_FIELD_BYTES)] or [b""]
    if len(chunks) > MAX_FIELDS:
        raise CommitmentError(
            f"commitment is {len(data)} bytes: {len(chunks)} fields of {RAW_FIELD_BYTES} bytes, "
            f"but the chain allows {MAX_FIELDS} ({MAX_ONCHAIN_BYTES} bytes)"
        )
    return {"fields": [{f"Raw{len(chunk)}": "0x" + chunk.hex()} for chunk in chunks]}


class BittensorChain:
    """:class:`~dtrain.chain.base.Chain` over a subtensor node (finney/test/local/ws URL).

    ``wallet`` is a ``bittensor.Wallet`` (its hotkey signs commits and weights);
    reads work without one. ``client`` or ``substrate`` inject a ready client
    or an SDK ``Substrate`` backend (tests).
    """

    def __init__(
        self,
        network: str,
        netuid: int,
        *,
        wallet: Any = None,
        substrate: Any = None,
        call_timeout: float = 60.0,
        read_retry: RetryPolicy = RetryPolicy(attempts=3, base_delay=1.0, max_delay=10.0),
        write_retry: RetryPolicy = RetryPolicy(attempts=5, base_delay=2.0, max_delay=30.0),
        sleep: Optional[Callable[[float], None]] = None,
    ):
        import bittensor as bt  # deferred: only the real-chain path needs the SDK

        self._bt = bt
        try:
            self._client = bt.Client(network, substrate=substrate)
        except bt.BittensorError as exc:
            raise ChainError(str(exc)) from exc
        self.network = self._client.network
        self.endpoint = self._client.endpoint
        self.netuid = int(netuid)
        self.wallet = wallet
        self.health = ChainHealth()
        self._network_errors = _network_errors(bt)
        self.call_timeout = call_timeout
        self.read_retry = read_retry
        self.write_retry = write_retry
        self._sleep = sleep
        self._connected = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="dtrain-chain-loop", daemon=True
        )
        self._thread.start()

    # -- plumbing -----------------------------------------------------------------

    @property
    def hotkey(self) -> Optional[str]:
        if self.wallet is None:
            return None
        return self.wallet.hotkey.ss58_address

    def _await(self, make: Callable[[], Awaitable[Any]]) -> Any:
        async def run() -> Any:
            if not self._connected:
                await self._client.connect()
                self._connected = True
            return await make()

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return future.result(timeout=self.call_timeout)
        except concurrent.futures.TimeoutError:
            if future.done():
                # The call itself raised TimeoutError (on 3.11+ the same class as
                # concurrent.futures'): an SDK timeout, passed on as it is.
                raise
            future.cancel()
            raise ChainUnavailable(
                f"{self.network}: no answer within {self.call_timeout:g}s"
            ) from None

    def _translate(self, exc: BaseException, what: str = "chain call") -> BaseException:
        """Map an SDK exception to the chain layer's errors.

        Returns a :class:`ChainError` (``ChainUnavailable`` only for network failures,
        which the retry layer retries) or a :class:`ChainClientBug` for programming
        errors, which nothing retries or swallows.
        """
        bt = self._bt
        if isinstance(exc, (ChainError, ChainClientBug)):
            return exc
        code = getattr(getattr(exc, "code", None), "name", "") or ""
        if code == "RATE_LIMITED":
            return RateLimited(str(exc))
        if code == "NOT_REGISTERED":
            return NotRegistered(str(exc))
        if code in ("NOT_AUTHORIZED", "NO_VALIDATOR_PERMIT"):
            return NotPermitted(str(exc))
        # ConnectionNotReady: a call on a client that was never connected or was closed,
        # which only dtrain's own sequencing can cause (_await connects first).
        if isinstance(exc, PROGRAMMING_ERRORS + (getattr(bt, "ConnectionNotReady", TypeError),)):
            return ChainClientBug(
                f"{self.network} {what}: bittensor {bittensor_version(bt)} raised "
                f"{type(exc).__name__}: {exc}. This is a bug in dtrain {DTRAIN_VERSION} or a "
                "bittensor version it does not support (it needs bittensor>=11,<12); "
                "not retried. Please report it with the traceback."
            )
        if isinstance(exc, self._network_errors):
            return ChainUnavailable(f"{self.network} ({self.endpoint}): {exc}")
        if isinstance(exc, bt.BittensorError):
            # The SDK (or the chain, for bt.ChainError) answered and refused: retrying the
            # same call gets the same answer.
            return ChainError(str(exc))
        # Anything else is unclassified: treat it as a transient failure, but keep its
        # type in the message so a recurring one can be recognised and classified.
        return ChainUnavailable(f"{self.network} ({self.endpoint}): {type(exc).__name__}: {exc}")

    def _call(
        self, what: str, make: Callable[[], Awaitable[Any]], *, write: bool = False, sdk: str = ""
    ) -> Any:
        """Run one SDK call under the retry policy. ``sdk`` names the SDK call for the
        bug report a programming error turns into."""
        label = f"{what} ({sdk})" if sdk else what

        def attempt() -> Any:
            try:
                return self._await(make)
            except Exception as exc:  # translated: callers see ChainError or ChainClientBug
                raise self._translate(exc, label) from exc

        kwargs = {"sleep": self._sleep} if self._sleep else {}
        return retry_call(
            attempt,
            policy=self.write_retry if write else self.read_retry,
            health=self.health,
            what=f"{self.network} {what}",
            **kwargs,
        )

    # -- Chain protocol -----------------------------------------------------------

    def block(self) -> int:
        return int(self._call("block", lambda: self._client.block(), sdk="Client.block"))

    def neurons(self) -> list[Neuron]:
        records = self._call(
            "neurons", lambda: self._client.neurons.all(self.netuid), sdk="Client.neurons.all"
        )
        return [
            Neuron(
                uid=int(n.uid),
                hotkey=str(n.hotkey),
                coldkey=str(n.coldkey) if n.coldkey else None,
                # Subnet stake is alpha, not TAO (the SDK refuses .tao on it); the
                # core only compares stakes, so units of 1e9 rao are enough.
                stake=int(n.total_stake.rao) / 1e9,
                validator_permit=bool(n.validator_permit),
            )
            for n in records
        ]

    def raw_commitments(self) -> dict[str, str]:
        entries = self._call(
            "commitments", lambda: self._client.subnets.commitments(self.netuid),
            sdk="Client.subnets.commitments",
        )
        return {str(hotkey): entry.data for hotkey, entry in entries.items() if entry.data}

    def commitments(self) -> dict[str, MinerCommitment]:
        return parse_commitments(self.raw_commitments(), log)

    def commit(self, record: MinerCommitment) -> bool:
        """Publish ``record``; False (no extrinsic) when it is already current.

        Skipping an unchanged record matters on a real chain: every
        ``set_commitment`` pays a deposit/fee and counts against the pallet's
        per-interval space limit, and miners re-commit on every start.
        """
        data = record.to_json()
        hotkey = self._require_wallet().hotkey.ss58_address
        current = self._call(
            "commitment", lambda: self._client.identity.commitment(self.netuid, hotkey),
            sdk="Client.identity.commitment",
        )
        if current is not None and getattr(current, "data", None) == data:
            return False
        self.commit_raw(data)
        return True

    def commit_raw(self, data: str) -> None:
        wallet = self._require_wallet()
        call = self._bt.calls.Commitments.set_commitment(
            netuid=self.netuid, info=commitment_info(data)
        )
        result = self._call(
            "commit", lambda: self._client.submit_call(call, wallet, signer="hotkey"), write=True,
            sdk="Client.submit_call(Commitments.set_commitment)",
        )
        self._check_result("commit", result)

    def set_weights(
        self, uids: Sequence[int], weights: Sequence[float], *, version_key: Optional[int] = None
    ) -> None:
        """Set weights through the SDK's ``SetWeights`` intent (plain or commit-reveal,
        whichever the subnet runs). ``version_key`` None: dtrain's :data:`SPEC_VERSION`, or
        :class:`OutdatedValidator` when the subnet's ``weights_version`` (read in the same
        attempt, so an owner's change applies at once) is newer (see ``choose_version_key``)."""
        wallet = self._require_wallet()
        uid_list, weight_list = [int(u) for u in uids], [float(w) for w in weights]

        async def submit() -> Any:
            key = version_key
            if key is None:
                key = choose_version_key(await self._weights_version())
            intent = self._bt.intents.SetWeights(
                netuid=self.netuid, uids=uid_list, weights=weight_list, version_key=int(key)
            )
            return await self._client.execute(intent, wallet)

        def attempt() -> Any:
            try:
                result = self._await(submit)
                self._check_result("set_weights", result)
                return result
            except Exception as exc:
                raise self._translate(exc, "set_weights (SetWeights intent)") from exc

        kwargs = {"sleep": self._sleep} if self._sleep else {}
        retry_call(
            attempt,
            policy=self.write_retry,
            health=self.health,
            what=f"{self.network} set_weights",
            **kwargs,
        )

    async def _weights_version(self) -> Optional[int]:
        """The subnet's ``weights_version`` hyperparameter (storage
        ``SubtensorModule.WeightsVersionKey``), or None when this runtime has no such
        item. Network failures propagate: the write is retried as a whole."""
        item = self._bt.storage.SubtensorModule.WeightsVersionKey
        try:
            value = await self._client.query(item, [self.netuid])
        except (self._bt.ChainError, ValueError) as exc:
            # ValueError: the SDK's "storage function not found" for a runtime without it.
            log.warning("cannot read weights_version of netuid %d (%s); sending dtrain's "
                        "spec version %d as version_key", self.netuid, exc, SPEC_VERSION)
            return None
        return None if value is None else int(value)

    def weights_version(self) -> Optional[int]:
        """The subnet's ``weights_version`` hyperparameter (None if the runtime lacks it)."""
        return self._call("weights_version", self._weights_version,
                          sdk="Client.query(SubtensorModule.WeightsVersionKey)")

    def weights(self) -> dict[int, dict[int, float]]:
        rows = self._call(
            "weights", lambda: self._client.weights.weights(self.netuid), sdk="Client.weights.weights"
        )
        return {int(v): {int(m): float(w) for m, w in row.items()} for v, row in rows.items()}

    def weights_status(self, uid: Optional[int] = None) -> WeightsStatus:
        st = self._bt.storage.SubtensorModule

        async def read() -> WeightsStatus:
            block = await self._client.block()
            rate = await self._client.hyperparameters.weights_rate_limit(self.netuid)
            target = uid
            if target is None and self.hotkey:
                target = await self._client.neurons.uid(self.hotkey, self.netuid)
            last = None
            if target is not None:
                # LastUpdate is keyed by the mechanism index, == netuid for mechanism 0.
                vector = await self._client.query(st.LastUpdate, [self.netuid])
                if isinstance(vector, (list, tuple)) and 0 <= target < len(vector):
                    last = int(vector[target]) or None
            return WeightsStatus(block=int(block), rate_limit=int(rate or 0), last_set_block=last)

        return self._call("weights_status", read, sdk="Client.hyperparameters.weights_rate_limit")

    def uid(self, hotkey: Optional[str] = None) -> Optional[int]:
        key = hotkey or self.hotkey
        if not key:
            raise ChainError("no hotkey given and no wallet configured")
        return self._call("uid", lambda: self._client.neurons.uid(key, self.netuid),
                          sdk="Client.neurons.uid")

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._connected:
            try:
                asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(timeout=10)
            except Exception as exc:  # closing a dead connection must not mask the real error
                log.debug("closing chain client: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "BittensorChain":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------

    def _require_wallet(self) -> Any:
        if self.wallet is None:
            raise ChainError("this operation signs with a hotkey: open the chain with a wallet")
        return self.wallet

    def _check_result(self, what: str, result: Any) -> None:
        if getattr(result, "success", False):
            return
        error = getattr(result, "error", None)
        if error is not None:
            raise self._translate(error, what)
        raise ChainError(f"{what} failed on chain: {getattr(result, 'message', '') or 'no detail'}")
