"""The round the round audit may ask about (dtrain.swarm.sent_round): a question that arrives
while our round is still ending waits for it; any other question is answered at once."""

from __future__ import annotations

import threading
import time

from dtrain.swarm.sent_round import SentRound


def test_a_question_for_the_round_still_ending_waits_for_its_end():
    sent = SentRound()
    sent.begin()
    threading.Timer(0.3, sent.end, args=("r1",)).start()
    t0 = time.monotonic()
    assert sent.wait_for("r1", 10.0)
    assert 0.25 <= time.monotonic() - t0 < 5
    assert sent.round_id == "r1"


def test_a_round_that_ends_uncommitted_or_as_another_answers_no():
    sent = SentRound()
    sent.begin()
    threading.Timer(0.2, sent.end, args=(None,)).start()
    assert not sent.wait_for("r1", 10.0)
    sent.begin()
    threading.Timer(0.2, sent.end, args=("r2",)).start()
    assert not sent.wait_for("r1", 10.0) and sent.round_id == "r2"


def test_without_a_running_round_the_answer_is_immediate_and_the_wait_is_bounded():
    sent = SentRound()
    t0 = time.monotonic()
    assert not sent.wait_for("r1", 10.0) and not sent.wait_for("", 10.0)
    assert time.monotonic() - t0 < 1
    sent.end("r1")
    assert sent.wait_for("r1", 0.0)
    sent.begin()  # a round that never ends: the question gives up at its timeout
    t0 = time.monotonic()
    assert not sent.wait_for("r1", 0.3)
    assert 0.25 <= time.monotonic() - t0 < 5
