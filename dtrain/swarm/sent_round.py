"""Which of our rounds the round audit may ask about: the last one we committed, and whether one
of ours is still running (docs/protocol.md, "Round audit").

A validator audits right after its own round ends; a member's round can end a moment later (its
last parts, its result check). An audit that comes in that moment waits for our round to end
instead of finding no committed round and naming an honest member as refused.
"""

from __future__ import annotations

import threading
import time
from typing import Optional


class SentRound:
    """The id of this peer's last committed round (``round_id``), None while a round runs."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = False
        self.round_id: Optional[str] = None

    def begin(self) -> None:
        """A round of ours starts: the averager keeps only its contribution from now on."""
        with self._changed:
            self.round_id, self._running = None, True

    def end(self, committed_round: Optional[str]) -> None:
        """Our round ended; ``committed_round`` is its id when we committed to what we sent, else None."""
        with self._changed:
            self.round_id, self._running = committed_round or None, False
            self._changed.notify_all()

    def wait_for(self, round_id: str, timeout_s: float) -> bool:
        """True when ``round_id`` is our last committed round, waiting up to ``timeout_s`` while a
        round of ours is still running; False at once when none is and it is not that round."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._changed:
            while self.round_id != round_id and self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return bool(round_id) and self.round_id == round_id
