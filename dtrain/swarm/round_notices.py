"""Round notices on the DHT: how every miner learns that a round begins, invited or not.

A validator that is about to join a round stores ``{epoch, round}`` under ``<prefix>_round``
with its peer id as subkey and the round's deadline as expiration. Every miner reads the key
and joins the round for its own epoch (dtrain.neurons.round_joining), so a round is joined
through the DHT, not by a validator's invitation (docs/protocol.md, "AllReduce"). Notices are
untrusted input: a forged one can only start a miner's matchmaking early, never give weight
or skip a check, and malformed ones are ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# a round id as the API writes one (dtrain.api.messages.ROUND_ID)
ROUND_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class RoundNotice:
    announcer: str  # the peer id that stored it
    epoch: int
    round_id: str


def _parse(announcer: str, value) -> RoundNotice | None:
    if not isinstance(value, dict):
        return None
    epoch, round_id = value.get("epoch"), value.get("round")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        return None
    if not isinstance(round_id, str) or not ROUND_ID.fullmatch(round_id):
        return None
    return RoundNotice(announcer, epoch, round_id)


class RoundNotices:
    """Announce a round, and read the rounds announced, via plain DHT store/get."""

    def __init__(self, dht, prefix: str, timeout_s: float = 10.0):
        self.dht = dht
        self.key = f"{prefix}_round"
        # A DHT process that died would otherwise block the caller forever.
        self.timeout_s = float(timeout_s)

    def announce(self, epoch: int, round_id: str, expiration_s: float) -> bool:
        from hivemind.utils.timed_storage import get_dht_time

        if not math.isfinite(expiration_s) or expiration_s <= 0:
            raise ValueError(f"expiration_s must be a positive number of seconds, got {expiration_s}")
        value = {"epoch": int(epoch), "round": str(round_id)}
        return bool(self.dht.store(self.key, subkey=str(self.dht.peer_id), value=value,
                                   expiration_time=get_dht_time() + float(expiration_s),
                                   return_future=True).result(timeout=self.timeout_s))

    def current(self) -> list[RoundNotice]:
        """The notices not yet expired, newest epoch first."""
        from hivemind.utils.timed_storage import ValueWithExpiration

        found = self.dht.get(self.key, latest=True, return_future=True).result(timeout=self.timeout_s)
        if found is None or not isinstance(found.value, dict):
            return []
        notices = []
        for subkey, item in found.value.items():
            if isinstance(item, ValueWithExpiration):
                notice = _parse(str(subkey), item.value)
                if notice is not None:
                    notices.append(notice)
        return sorted(notices, key=lambda n: (-n.epoch, n.announcer))
