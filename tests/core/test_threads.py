"""The default torch thread count: never more than the cores this process may use, fewer when other
processes are keeping cores busy (benchmarks/threads.py measures why)."""

import multiprocessing
import os
import time

from dpaudit.core import threads


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


def test_the_governor_leaves_a_core_another_process_took_and_takes_it_back(monkeypatch):
    """Between steps the default thread count follows the load: both cores busy with other work -> 1 thread;
    quiet again -> all usable cores; an interval under 0.5 s is too short to judge and runs on."""
    import time

    import torch

    import dpaudit.core.threads as th

    clock, ticks = {"t": 0.0}, {"busy": 0, "total": 0}
    monkeypatch.setattr(th, "_cpus", lambda: {0, 1})
    monkeypatch.setattr(th, "cpu_quota", lambda: None)
    monkeypatch.setattr(th, "_cpu_times", lambda cpus: {c: (ticks["busy"], ticks["total"]) for c in cpus})
    monkeypatch.setattr(time, "monotonic", lambda: clock["t"])
    kept = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        governor = th.Governor()

        def elapse(seconds: float, busy_share: float):
            clock["t"] += seconds
            ticks["total"] += int(100 * seconds)
            ticks["busy"] += int(100 * seconds * busy_share)

        elapse(0.2, 1.0)
        assert governor.adapt() is None and torch.get_num_threads() == 2  # too short: judged later
        elapse(1.0, 1.0)  # 1.2 s with both cores busy, this process idle: others hold them
        assert governor.adapt() == 1 and torch.get_num_threads() == 1
        elapse(1.0, 0.0)
        assert governor.adapt() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(kept)
