"""Hypothesis profiles of the fuzz tests (tests/test_fuzz_*.py): `ci` (the default) keeps all of them together near a
minute on two cores, `thorough` tries thousands of cases per family. Pick one with HYPOTHESIS_PROFILE, e.g.

    HYPOTHESIS_PROFILE=thorough pytest tests/test_fuzz_shards.py tests/test_fuzz_inputs.py tests/test_fuzz_remote.py \
        --hypothesis-show-statistics

Both are derandomized (the cases follow from the test's code alone), so a failure found once is found again."""

import os
import signal
from contextlib import contextmanager

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
settings.register_profile("ci", max_examples=40, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def scaled(n: int) -> int:
    """`n` cases under `ci` for a test whose cases are slow (a server, a folder tree, a shards folder), x40 under
    `thorough`."""
    return n * 40 if settings.default.max_examples >= 1000 else n


@contextmanager
def no_hang(seconds: float):
    """Fail with TimeoutError when the block runs longer than `seconds` (a reader that loops forever on bad input)."""

    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s: the reader hangs on this input")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
