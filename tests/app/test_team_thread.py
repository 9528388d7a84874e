"""A worker's torch calls on more than one thread all run on one thread (TeamThread), so that
the process keeps one OpenMP team and libgomp keeps spinning between a forward's regions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from app.services.threads import TeamThread, place_team

# Three caller threads, each making a torch call on 2 threads that starts a parallel region;
# prints how many threads the process gained. `team`: through a TeamThread; `direct`: each
# on its own thread, as the service did before.
CALLERS = """
import os, sys, threading, torch
from app.services.threads import TeamThread, on_threads
torch.set_num_threads(1)
before = len(os.listdir("/proc/self/task"))
team = TeamThread(size=2)
big = torch.ones(4_000_000)
def call():  # far above torch's grain size: a parallel region on every thread it is given
    return float(big.mul(2.0).sum())
hold = threading.Event()
def caller():
    if sys.argv[1] == "team":
        team.run(2, call)
    else:
        on_threads(2, call)
    hold.wait(30)  # alive: a thread's OpenMP team lives as long as it does
callers = [threading.Thread(target=caller) for _ in range(3)]
for t in callers:
    t.start()
    t.join(0.5)  # one after the other: each finds the team thread free
print(len(os.listdir("/proc/self/task")) - before - len(callers), flush=True)
hold.set()
"""


# The team thread busy with a call on 2 threads, a caller's call on its share of 2 threads;
# prints how many threads the process holds beyond the caller and the team thread's team once
# that call has returned (the caller alive). `team`: through the TeamThread; `caller`: on the
# caller's own thread, as the service did before.
BUSY = """
import os, sys, threading, time, torch
from app.services.threads import TeamThread, on_threads
torch.set_num_threads(1)
before = len(os.listdir("/proc/self/task"))
team = TeamThread(size=2)
big = torch.ones(4_000_000)
inside, release, done = threading.Event(), threading.Event(), threading.Event()
def long_call():
    big.mul(2.0).sum()  # the team thread's team exists
    inside.set()
    release.wait(30)
def call():
    return float(big.mul(2.0).sum())
def caller():
    if sys.argv[1] == "team":
        team.run(2, call, busy_threads=2)
    else:
        on_threads(2, call)
    done.set()
    release.wait(30)
busy = threading.Thread(target=lambda: team.run(2, long_call))
busy.start()
inside.wait(30)
alive = threading.Thread(target=caller)
alive.start()
done.wait(30)
fewest = 99
for _ in range(100):  # a thread's team goes after Python has joined it: what is left, at least
    fewest = min(fewest, len(os.listdir("/proc/self/task")) - before)
    time.sleep(0.02)
print(fewest - 4, flush=True)  # beyond the team thread, its worker and the two callers
release.set()
"""


@pytest.mark.parametrize(("how", "left"), [("team", 0), ("caller", 1)])
def test_a_call_beside_the_busy_team_thread_leaves_no_openmp_team(how: str, left: int) -> None:
    """A call on more than one thread while the team thread is busy: on a thread of its own that
    ends with it, its OpenMP team goes too; on its caller's thread, the team stays as long as
    the caller lives, and libgomp keeps every team from spinning."""
    out = subprocess.run(
        [sys.executable, "-c", BUSY, how], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == left


@pytest.mark.parametrize(("how", "gained"), [("team", 2), ("direct", 3)])
def test_calls_from_many_threads_keep_one_openmp_team(how: str, gained: int) -> None:
    """Through the team thread: that thread and its one OpenMP worker, however many callers;
    directly: one OpenMP worker per caller (what made libgomp stop spinning)."""
    out = subprocess.run(
        [sys.executable, "-c", CALLERS, how], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == gained


def test_a_call_given_several_threads_runs_on_the_team_thread() -> None:
    team = TeamThread()
    try:
        seen = team.run(
            3,
            lambda: (
                threading.current_thread().name,
                torch.get_num_threads(),
                torch.is_inference_mode_enabled(),
            ),
        )
        assert seen[0].startswith("torch-team")
        assert seen[1:] == (3, True)
        mine = team.run(1, lambda: (threading.current_thread(), torch.get_num_threads()))
        assert mine == (threading.current_thread(), 1)  # one thread: no hop
    finally:
        team.shutdown()


def test_while_the_team_thread_is_busy_a_call_runs_with_the_workers_share() -> None:
    team = TeamThread()
    inside, release = threading.Event(), threading.Event()

    def long_call() -> str:
        inside.set()
        release.wait(10)
        return threading.current_thread().name

    first: list[str] = []
    t = threading.Thread(target=lambda: first.append(team.run(2, long_call)))
    t.start()
    try:
        assert inside.wait(10)
        where = (threading.current_thread(), 1)
        assert team.run(4, lambda: (threading.current_thread(), torch.get_num_threads())) == where
        # the worker's share, when it is more than one, on a thread made for the call
        got = team.run(4, lambda: (threading.current_thread().name, torch.get_num_threads()), 2)
        assert got[0].startswith("torch-overlap")
        assert got[1] == 2

        def broken() -> None:
            raise ValueError("tower broke beside a busy team thread")

        with pytest.raises(ValueError, match="beside a busy team thread"):
            team.run(4, broken, 2)  # raised to its caller from the thread made for it
    finally:
        release.set()
        t.join(10)
    assert first[0].startswith("torch-team")
    team.shutdown()


def test_a_failing_call_raises_to_its_caller_and_frees_the_team_thread() -> None:
    team = TeamThread()

    def broken() -> None:
        raise ValueError("tower broke")

    try:
        with pytest.raises(ValueError, match="tower broke"):
            team.run(2, broken)
        assert team.run(2, lambda: threading.current_thread().name).startswith("torch-team")
    finally:
        team.shutdown()


# A team thread given core `argv[1]`, its first call on 2 threads: prints the cores of the
# caller, of the team thread, and of each thread the call started.
PLACED = """
import json, os, sys, threading, torch
from app.services.threads import TeamThread
torch.set_num_threads(1)
before = set(os.listdir("/proc/self/task"))
team = TeamThread(core=int(sys.argv[1]), size=2)
def call():  # a parallel region on both threads
    return threading.get_native_id(), float(torch.ones(1 << 20).mul(2).sum())
team_thread = team.run(2, call)[0]
started = set(os.listdir("/proc/self/task")) - before - {str(team_thread)}
print(json.dumps({
    "caller": sorted(os.sched_getaffinity(0)),
    "team_thread": sorted(os.sched_getaffinity(team_thread)),
    "started": [sorted(os.sched_getaffinity(int(t))) for t in started],
}))
"""

cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.skipif(len(cores) < 2, reason="placing a team takes two cores")
@pytest.mark.parametrize("core", [0, 1, len(cores) + 1])
def test_the_team_thread_takes_its_core_and_its_team_the_others(core: int) -> None:
    """Placed, the team's OpenMP thread never shares the team thread's core (where the
    scheduler may wake it, unplaced), and the caller keeps every core."""
    out = subprocess.run(
        [sys.executable, "-c", PLACED, str(core)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    own = cores[core % len(cores)]
    assert seen["caller"] == cores
    assert seen["team_thread"] == [own]
    assert seen["started"] == [[c for c in cores if c != own]]


def test_a_team_of_one_thread_is_not_placed() -> None:
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert place_team(1, 0) is False
    if before is not None:
        assert os.sched_getaffinity(0) == before
