"""Inclusive wall time and call counts of functions, for the step-breakdown scripts: `timed(name, fn)` wraps one,
`time_methods([(cls, [names])])` wraps methods in place; `spent` and `calls` hold the totals."""

import collections
import functools
import time

spent: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def timed(name, fn):
    @functools.wraps(fn)
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t
            calls[name] += 1

    return run


def time_methods(owners_and_names) -> None:
    for owner, names in owners_and_names:
        for n in names:
            setattr(owner, n, timed(f"{owner.__name__}.{n}", getattr(owner, n)))
