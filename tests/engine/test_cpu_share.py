"""The engine's threads beside other busy processes (runtime/cpu_share.py): it runs on the cores
they leave it, and takes all of its threads back when they stop. The throughput this buys is
benchmarks/cpu_share.py's, not a timed test."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from trine.engine.runtime import cpu_share
from trine.engine.runtime.cpu_share import CpuShare, busy_seconds, fair_threads


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_engine_leaves_other_processes_the_cores_they_use():
    assert fair_threads(2, 2, 0.0) == 2
    assert fair_threads(2, 2, 0.3) == 2  # a light neighbour
    assert fair_threads(2, 2, 0.7) == 1  # a 1-core hog sharing 2 cores with 2 spinning threads
    assert fair_threads(2, 2, 2.0) == 1  # never below one thread
    assert fair_threads(4, 16, 9.0) == 4  # cores to spare: the configured count
    assert fair_threads(8, 8, 2.0) == 6


def test_busy_time_counts_only_the_cpus_the_process_may_run_on():
    tick = cpu_share._TICK
    stat = (
        f"cpu  {9 * tick} 0 0 0 0 0 0 0 0 0\n"
        f"cpu0 {2 * tick} {tick} {tick} {50 * tick} {7 * tick} 0 0 {3 * tick} 0 0\n"
        f"cpu1 {tick} 0 0 {50 * tick} 0 {tick} {tick} 0 0 0\n"
        "intr 12345 0 0\nctxt 999\n"
    )
    assert busy_seconds({0}, stat) == pytest.approx(4.0)  # user + nice + system; not idle, iowait, steal
    assert busy_seconds({1}, stat) == pytest.approx(3.0)  # irq and softirq are busy time
    assert busy_seconds({0, 1}, stat) == pytest.approx(7.0)
    assert busy_seconds({0}, "cpu0 12 x") is None  # unreadable: the engine keeps its threads


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_busy_time_is_read_from_proc_stat():
    cpus = set(os.sched_getaffinity(0))
    before = busy_seconds(cpus)
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert before is not None and busy_seconds(cpus) > before


class Machine:
    """A fake clock and CPU counters: each `run(seconds, others)` is that long of engine work with
    other processes busy on `others` cores."""

    def __init__(self, own_cores: float = 2.0):
        self.now = self.busy = self.own = 0.0
        self.own_cores = own_cores

    def read(self):
        return self.busy, self.own

    def clock(self):
        return self.now

    def run(self, share: CpuShare, seconds: float, others: float) -> int:
        self.now += seconds
        self.own += seconds * min(self.own_cores, share.threads)
        self.busy += seconds * (min(self.own_cores, share.threads) + others)
        return share.adapt()


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back_when_it_stops():
    m = Machine()
    share = CpuShare(2, cpus={0, 1}, read=m.read, clock=m.clock)
    torch.set_num_threads(2)
    assert m.run(share, 0.3, 0.0) == 2  # the first reading only marks the start
    assert m.run(share, 0.3, 0.9) == 2  # asked once: not yet
    assert m.run(share, 0.3, 0.9) == 1  # asked twice in a row
    assert torch.get_num_threads() == 1
    assert m.run(share, 0.3, 1.0) == 1
    assert m.run(share, 0.3, 0.0) == 1  # the hog stopped: asked once
    assert m.run(share, 0.3, 0.0) == 2
    assert torch.get_num_threads() == 2


def test_a_blip_or_an_idle_gap_moves_nothing():
    m = Machine()
    share = CpuShare(2, cpus={0, 1}, read=m.read, clock=m.clock)
    m.run(share, 0.3, 0.0)
    assert m.run(share, 0.3, 1.5) == 2  # one busy reading
    assert m.run(share, 0.3, 0.0) == 2
    assert m.run(share, 0.3, 1.5) == 2  # not two in a row
    assert m.run(share, 0.1, 1.5) == 2  # too soon for a reading
    m.now += 60  # the engine was idle; what the machine did meanwhile says nothing of now
    m.busy += 60 * 2
    assert m.run(share, 0.0, 0.0) == 2  # the reading after the gap starts afresh
    assert m.run(share, 0.3, 1.5) == 2  # so this busy one is the first
    assert m.run(share, 0.3, 1.5) == 1


def test_it_can_be_turned_off(monkeypatch):
    m = Machine()
    monkeypatch.setenv("TRINE_CPU_SHARE", "0")
    share = CpuShare(2, cpus={0, 1}, read=m.read, clock=m.clock)
    for _ in range(4):
        assert m.run(share, 0.3, 2.0) == 2
    assert not CpuShare(2, cpus={0, 1}, read=lambda: (None, 0.0)).enabled  # no /proc/stat


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp is torch's runtime on Linux")
def test_a_thread_can_let_go_of_its_openmp_workers_and_run_parallel_ops_after():
    x = torch.randn(512, 512)
    expected = x @ x  # this thread's OpenMP pool exists now
    assert cpu_share.release_openmp_pool()
    assert torch.equal(x @ x, expected)  # made again on the next parallel op
