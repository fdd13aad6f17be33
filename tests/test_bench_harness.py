"""benchmarks/harness.py's timing helpers on a fake clock: each call's time is its own, warm-up calls are not timed,
a stopping rule ends the timing, and on CUDA the events pair up as documented (back to back: one call's end event is
the next one's start; with a stopping rule, a fresh pair per call). No real time is asserted."""

import pytest
import torch

from benchmarks import harness


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(harness, "time", fake)
    return fake


def calls_taking(clock: FakeClock, durations: list[float]):
    """A call that advances the fake clock by the next of `durations`, and the list of calls made so far."""
    made = []

    def call():
        clock.now += durations[len(made)]
        made.append(durations[len(made)])

    return call, made


def test_cpu_calls_are_timed_one_by_one_after_the_warm_up(clock):
    call, made = calls_taking(clock, [7.0, 9.0, 0.5, 1.25, 2.0])
    times = harness.call_times(call, torch.device("cpu"), warmup=2, repeats=3)
    assert made == [7.0, 9.0, 0.5, 1.25, 2.0]  # 2 warm-up calls, then 3 timed ones
    assert times.seconds == [0.5, 1.25, 2.0] and times.host_seconds == [0.5, 1.25, 2.0]


def test_a_stopping_rule_ends_the_timing_after_the_call_that_satisfies_it(clock):
    call, made = calls_taking(clock, [1.0, 2.0, 3.0, 4.0])
    times = harness.cpu_call_times(call, repeats=4, until=lambda seconds: sum(seconds) >= 3.0)
    assert times.seconds == [1.0, 2.0] and len(made) == 2


def test_timed_without_a_device_reads_the_host_clock(clock):
    with harness.timed() as block:
        clock.now += 2.5
    assert block.seconds == 2.5
    watch = harness.Stopwatch()
    clock.now += 0.75
    assert watch.seconds() == 0.75


class FakeEvent:
    """A CUDA event on the fake clock: recorded at the clock's time (the device idles for the host, so its clock is
    the host's); every event made is listed in `made`."""

    made: list = []
    synchronized = 0

    def __init__(self, enable_timing: bool):
        assert enable_timing
        self.at = None
        FakeEvent.made.append(self)

    def record(self):
        self.at = FakeEvent.clock.now

    def synchronize(self):
        FakeEvent.synchronized += 1

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA events report


@pytest.fixture
def cuda_events(monkeypatch, clock):
    monkeypatch.setattr(FakeEvent, "made", [])
    monkeypatch.setattr(FakeEvent, "synchronized", 0)
    monkeypatch.setattr(FakeEvent, "clock", clock, raising=False)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(harness, "sync", lambda device: None)
    return FakeEvent


def test_cuda_calls_queued_back_to_back_share_their_boundary_events(clock, cuda_events):
    call, _ = calls_taking(clock, [5.0, 0.5, 0.25, 2.0])
    times = harness.call_times(call, torch.device("cuda"), warmup=1, repeats=3)
    assert times.seconds == [0.5, 0.25, 2.0] and times.host_seconds == [0.5, 0.25, 2.0]
    assert len(cuda_events.made) == 3 + 1 and cuda_events.synchronized == 0  # the host waits once, at the end


def test_cuda_calls_with_a_stopping_rule_each_get_their_own_events_and_a_wait(clock, cuda_events):
    call, made = calls_taking(clock, [0.5, 0.25, 2.0, 1.0])
    times = harness.cuda_call_times(call, torch.device("cuda"), repeats=4, until=lambda s: len(s) == 3)
    assert times.seconds == [0.5, 0.25, 2.0] and len(made) == 3
    assert len(cuda_events.made) == 2 * 3 and cuda_events.synchronized == 3
