"""When a neuron restarts its swarm node (dtrain/neurons/swarm_health.py): at once for a dead
process, after repeated silence for a live one, with backoff after failed restarts."""

from __future__ import annotations

from dtrain.neurons.swarm_health import RESTART_BACKOFF_S, SILENT_CHECKS, SWARM_CHECK_S, Finding, SwarmWatch


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_healthy_node_is_checked_every_interval_and_never_restarted():
    clock = Clock()
    watch = SwarmWatch(clock)
    assert watch.due()
    assert watch.judge(Finding()) is None
    assert not watch.due()
    clock.now += SWARM_CHECK_S
    assert watch.due()


def test_a_dead_process_is_restarted_at_once():
    watch = SwarmWatch(Clock())
    assert watch.judge(Finding("the DHT process is not running (killed by SIGKILL)", dead=True)) == \
        "the DHT process is not running (killed by SIGKILL)"


def test_a_silent_process_is_restarted_only_when_it_stays_silent():
    watch = SwarmWatch(Clock())
    silent = Finding("the DHT process did not answer within 10 s")
    for _ in range(SILENT_CHECKS - 1):
        assert watch.judge(silent) is None
    assert "did not answer" in watch.judge(silent)
    # one good answer in between starts the count again
    watch.restarted(ok=True)
    assert watch.judge(silent) is None
    assert watch.judge(Finding()) is None
    assert watch.judge(silent) is None


def test_failed_restarts_back_off_and_a_good_one_resets_the_backoff():
    clock = Clock()
    watch = SwarmWatch(clock)
    waits = [watch.restarted(ok=False) for _ in range(len(RESTART_BACKOFF_S) + 2)]
    assert waits[:len(RESTART_BACKOFF_S)] == list(RESTART_BACKOFF_S)
    assert waits[-1] == RESTART_BACKOFF_S[-1]  # capped
    assert not watch.due()
    clock.now += RESTART_BACKOFF_S[-1]
    assert watch.due()
    assert watch.restarted(ok=True) == SWARM_CHECK_S
    assert watch.restarted(ok=False) == RESTART_BACKOFF_S[0]
