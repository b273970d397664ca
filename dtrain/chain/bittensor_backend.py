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

from dtrain.chain.base import (
    ChainError,
    ChainHealth,
    ChainUnavailable,
    Neuron,
    NotPermitted,
    NotRegistered,
    RateLimited,
    WeightsStatus,
)
from dtrain.chain.commitment import MinerCommitment, parse_commitments
from dtrain.chain.retry import RetryPolicy, retry_call

log = logging.getLogger("dtrain.chain")

# The Commitments pallet stores Data::RawN fields of at most 128 bytes.
_RAW_FIELD_MAX = 128


def commitment_info(text: str) -> dict:
    """``CommitmentInfo`` for ``set_commitment``: the UTF-8 text split into
    Raw fields of <= 128 bytes (readers concatenate Raw fields in order).

    The shape mirrors what the SDK decodes from ``CommitmentOf`` (a flat list
    of ``{"RawN": "0x…"}``), so a record round-trips through the SDK reader.
    """
    data = text.encode("utf-8")
    chunks = [data[i : i + _RAW_FIELD_MAX] for i in range(0, len(data), _RAW_FIELD_MAX)] or [b""]
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
            future.cancel()
            raise ChainUnavailable(
                f"{self.network}: no answer within {self.call_timeout:g}s"
            ) from None

    def _translate(self, exc: BaseException) -> ChainError:
        bt = self._bt
        if isinstance(exc, ChainError):
            return exc
        code = getattr(getattr(exc, "code", None), "name", "") or ""
        if code == "RATE_LIMITED":
            return RateLimited(str(exc))
        if code == "NOT_REGISTERED":
            return NotRegistered(str(exc))
        if code in ("NOT_AUTHORIZED", "NO_VALIDATOR_PERMIT"):
            return NotPermitted(str(exc))
        if isinstance(exc, (bt.RpcConnectionError, ConnectionError, OSError, asyncio.TimeoutError)):
            return ChainUnavailable(f"{self.network} ({self.endpoint}): {exc}")
        if isinstance(exc, bt.ChainError):
            return ChainError(str(exc))
        return ChainUnavailable(f"{self.network}: {type(exc).__name__}: {exc}")

    def _call(self, what: str, make: Callable[[], Awaitable[Any]], *, write: bool = False) -> Any:
        def attempt() -> Any:
            try:
                return self._await(make)
            except Exception as exc:  # translated: callers only see ChainError
                raise self._translate(exc) from exc

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
        return int(self._call("block", lambda: self._client.block()))

    def neurons(self) -> list[Neuron]:
        records = self._call("neurons", lambda: self._client.neurons.all(self.netuid))
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
        entries = self._call("commitments", lambda: self._client.subnets.commitments(self.netuid))
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
            "commitment", lambda: self._client.identity.commitment(self.netuid, hotkey)
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
            "commit", lambda: self._client.submit_call(call, wallet, signer="hotkey"), write=True
        )
        self._check_result("commit", result)

    def set_weights(self, uids: Sequence[int], weights: Sequence[float]) -> None:
        wallet = self._require_wallet()
        intent = self._bt.intents.SetWeights(
            netuid=self.netuid, uids=[int(u) for u in uids], weights=[float(w) for w in weights]
        )

        def submit() -> Any:
            result = self._await(lambda: self._client.execute(intent, wallet))
            self._check_result("set_weights", result)
            return result

        def attempt() -> Any:
            try:
                return submit()
            except Exception as exc:
                raise self._translate(exc) from exc

        kwargs = {"sleep": self._sleep} if self._sleep else {}
        retry_call(
            attempt,
            policy=self.write_retry,
            health=self.health,
            what=f"{self.network} set_weights",
            **kwargs,
        )

    def weights(self) -> dict[int, dict[int, float]]:
        rows = self._call("weights", lambda: self._client.weights.weights(self.netuid))
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

        return self._call("weights_status", read)

    def uid(self, hotkey: Optional[str] = None) -> Optional[int]:
        key = hotkey or self.hotkey
        if not key:
            raise ChainError("no hotkey given and no wallet configured")
        return self._call("uid", lambda: self._client.neurons.uid(key, self.netuid))

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
            raise self._translate(error)
        raise ChainError(f"{what} failed on chain: {getattr(result, 'message', '') or 'no detail'}")
