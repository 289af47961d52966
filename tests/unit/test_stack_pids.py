"""`infra.stack down` signals only the process groups `up` started: a recorded pid that a later
process (or, after a reboot, any process) now holds is left alone."""

from __future__ import annotations

import subprocess
import sys

from infra import stack


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def test_down_stops_our_group_and_spares_a_process_that_reuses_the_pid() -> None:
    ours, stranger = _sleeper(), _sleeper()
    try:
        entry = {"pid": ours.pid, **stack.identity(ours.pid), "argv": ["python"]}
        assert stack._ours(entry) and stack._our_group(entry)
        # The stranger's pid recorded with another start time: what a reused pid looks like.
        reused = {"pid": stranger.pid, **stack.identity(stranger.pid), "argv": ["python"]}
        reused["start_ticks"] -= 1
        rebooted = {**stack.identity(stranger.pid), "pid": stranger.pid, "boot_id": "another-boot"}
        assert not stack._our_group(reused) and not stack._our_group(rebooted)
        stopped = stack._stop([entry, reused, rebooted], grace_s=5)
        assert [e["pid"] for e in stopped] == [ours.pid]
        assert ours.wait(timeout=10) != 0 and stranger.poll() is None
    finally:
        for proc in (ours, stranger):
            proc.kill()
            proc.wait()
