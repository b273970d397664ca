"""The sandbox's miners run at a lower CPU priority than its validators (on the subnet a
validator has its own machine): a real child in a session of its own, as the sandbox starts
each neuron, lowered by its process nice and, where Linux has autogroups, by its session's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dtrain.sandbox.orchestrator import MINER_NICENESS, lower_priority


def test_a_neuron_session_is_lowered_with_everything_it_starts_later():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; time.sleep(0.5); "
                              "print(subprocess.check_output(['sh', '-c', 'cut -d\" \" -f19 /proc/$$/stat']).decode())"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lower_priority(child.pid, MINER_NICENESS)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == MINER_NICENESS
        autogroup = Path(f"/proc/{child.pid}/autogroup")
        if autogroup.exists():
            # the share between sessions: without it the process nice does not count across them
            assert autogroup.read_text().split()[-1] == str(MINER_NICENESS)
        out, _ = child.communicate(timeout=30)
        assert int(out.strip()) == MINER_NICENESS  # a process it started afterwards inherits it
    finally:
        child.kill()
        child.wait()
    lower_priority(child.pid, MINER_NICENESS)  # gone by now: nothing to lower, and no error
