"""The default torch thread count: never more than the cores this process may use, fewer when other
processes are keeping cores busy (benchmarks/threads.py measures why)."""

import multiprocessing
import os
import time

from dpaudit import threads


def _spin():
    while True:
        pass


def test_default_never_exceeds_the_usable_cores():
    assert 1 <= threads.default_threads() <= len(os.sched_getaffinity(0))


def test_busy_cores_sees_a_spinning_process():
    cpus = set(os.sched_getaffinity(0))
    spinner = multiprocessing.Process(target=_spin, daemon=True)
    spinner.start()
    try:
        time.sleep(0.3)
        busy = threads.busy_cores(cpus, interval=0.3)
    finally:
        spinner.terminate()
    assert busy >= 0.7  # one core taken (the machine may be busier still)


def test_default_leaves_out_cores_that_are_busy(monkeypatch):
    cpus = set(os.sched_getaffinity(0))
    monkeypatch.setattr(threads, "cpu_quota", lambda: None)
    monkeypatch.setattr(threads, "busy_cores", lambda cpus, interval=0.1: 1.0)
    assert threads.default_threads() == max(1, len(cpus) - 1)
    monkeypatch.setattr(threads, "busy_cores", lambda cpus, interval=0.1: 0.0)
    assert threads.default_threads() == len(cpus)
