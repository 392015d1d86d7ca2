"""A follower rank killed (SIGKILL) or frozen (SIGSTOP) during a tensor-parallel generation: rank 0's
stream fails with DistributedError within its distributed timeout (counted from the last completed step)
instead of waiting for ever, later calls fail at once, and rank 0 closes and exits. (Slow: two processes
on the ring backend over loopback, started as tests/test_distributed.py starts them.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed import _ports

HERE = Path(__file__).resolve().parent
TIMEOUT = 20.0
"""Rank 0's distributed timeout here: far above a step of the tiny fixture, even on a loaded machine."""
SLACK = 60.0
"""What a loaded machine may add to the timeout before rank 0 reports (its watchdog wakes at the deadline)."""
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("lost", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_rank_zero_fails_within_its_timeout_when_a_follower_is_lost(tmp_path: Path, lost: signal.Signals) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in _ports(2)]))
    argv = [sys.executable, str(HERE / "lost_rank.py"), str(TIMEOUT)]
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
    leader_log, follower_log = (tmp_path / "rank0.log").open("w"), (tmp_path / "rank1.log").open("w")
    leader = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=leader_log, text=True,
                              env={**env, "MLX_RANK": "0"})
    follower = subprocess.Popen(argv, stdout=follower_log, stderr=subprocess.STDOUT, env={**env, "MLX_RANK": "1"})
    try:
        assert leader.stdin is not None and leader.stdout is not None
        lines = []
        while (line := leader.stdout.readline()) and line != "streaming\n":
            lines.append(line)
        assert line == "streaming\n", "".join(lines) + (tmp_path / "rank0.log").read_text()[-3000:]
        follower.send_signal(lost)  # mid-generation: rank 0 is a token ahead of its reader, 1990 to go
        if lost == signal.SIGKILL:
            follower.wait(timeout=30)
        leader.stdin.write("go\n")
        leader.stdin.flush()
        out, _ = leader.communicate(timeout=TIMEOUT + SLACK + 120)  # and it exits: nothing left waiting
    finally:
        for process in (leader, follower):
            if process.poll() is None:
                process.kill()
                process.wait()
        leader_log.close()
        follower_log.close()
    assert leader.returncode == 0, out + (tmp_path / "rank0.log").read_text()[-3000:]
    record = json.loads(out.splitlines()[-1])
    assert record["error"] is not None and "lost its process group" in record["error"], record
    assert record["seconds"] <= TIMEOUT + SLACK, record
    assert "lost its process group" in record["later"], record
