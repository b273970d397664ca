"""Questions a round's members ask a sender about what it sent, on dtrain's own protocol ``kept``.

After the butterfly, a receiver asks each sender for the sketches of its parts under the round's
result seed (the result check, dtrain.swarm.result_checking) and, to settle a dispute, for
parts' wire bytes. A node keeps what it sent in its last committed round only
(:meth:`KeptRounds.keep`: memory stays flat), answers that round's members only, each at most
once per part's bytes and for at most MAX_SEEDS_PER_ROUND seeds (averaging.kept, which also
gives the question and answer formats; docs/protocol.md, "Result check").

One stream per question: the asker sends ``ASK`` (msgpack ``{"r": round id, "q": question
bytes}``); the sender answers ``ANSWER`` (the answer bytes) or ``REFUSED`` (a UTF-8 reason).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional, Sequence

from dtrain.swarm.averaging.kept import SentContribution
from dtrain.swarm.averaging.result_check import result_nonce
from dtrain.swarm.transport import Transport, TransportError, read_frame, write_frame

logger = logging.getLogger(__name__)

PROTOCOL = "kept"
ASK, ANSWER, REFUSED = 1, 2, 3
# How long a served stream waits for its question (an opener that sends nothing is dropped).
ASK_TIMEOUT_S = 30.0


class KeptRounds:
    """What this node sent in its last committed round, and its answers about it."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._round_id: Optional[str] = None
        self._sent: Optional[SentContribution] = None
        transport.handle(PROTOCOL, self._serve)

    def keep(self, round_id: str, sent: SentContribution) -> None:
        """Keep ``sent`` (a copy of what goes into round ``round_id``), replacing the last round's;
        nobody may ask about it until :meth:`admit` names the round's members."""
        sent.round_id, sent.members = round_id, frozenset()
        self._round_id, self._sent = round_id, sent

    def admit(self, round_id: str, members: Sequence[str]) -> None:
        """The members of round ``round_id`` may ask about what we sent in it (once it is fixed)."""
        if self._round_id == round_id and self._sent is not None:
            self._sent.members = frozenset(members)

    def sent(self, round_id: str) -> Optional[SentContribution]:
        """What we sent in round ``round_id``; None once another round replaced it."""
        return self._sent if self._round_id == round_id else None

    async def _serve(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import msgpack

        frame = await asyncio.wait_for(read_frame(reader), ASK_TIMEOUT_S)
        try:
            doc = msgpack.unpackb(frame.payload, raw=False) if frame.kind == ASK else None
            round_id, question = str(doc["r"]), bytes(doc["q"])
        except Exception:
            await write_frame(writer, REFUSED, b"a question is ASK {r, q}")
            return
        sent = self.sent(round_id)
        if sent is None:
            await write_frame(writer, REFUSED, f"round {round_id} is not kept here (only the last round is)".encode())
            return
        try:
            answer = await sent.answer_member(question, peer, result_nonce)
        except ValueError as exc:
            await write_frame(writer, REFUSED, f"a malformed question: {exc}".encode()[:300])
            return
        if answer is None:
            await write_frame(writer, REFUSED, b"not a member of the round, or asked this before")
            return
        await write_frame(writer, ANSWER, answer)

    async def ask_member(self, peer: str, group_id: bytes, payload: bytes, timeout_s: float) -> Optional[bytes]:
        """Ask ``peer`` about round ``group_id`` (its id, UTF-8); its answer, or None (refused,
        silent within ``timeout_s``, or unreachable). The asking side of averaging.kept's helpers."""
        import msgpack

        writer = None
        try:
            reader, writer = await asyncio.wait_for(self.transport.open(peer, PROTOCOL), timeout_s)
            await write_frame(writer, ASK, msgpack.packb({"r": group_id.decode(), "q": bytes(payload)},
                                                         use_bin_type=True))
            frame = await asyncio.wait_for(read_frame(reader), timeout_s)
        except (asyncio.TimeoutError, TransportError, ConnectionError, OSError) as exc:
            logger.info("question to %s about round %s: no answer (%s)", peer, group_id.decode(errors="replace"),
                        exc or type(exc).__name__)
            return None
        finally:
            if writer is not None:
                writer.close()
        if frame.kind != ANSWER:
            logger.info("question to %s refused: %s", peer, frame.payload.decode(errors="replace")[:200])
            return None
        return frame.payload
