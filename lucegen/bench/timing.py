"""Device-event timing: warm up, repeat, take the median."""
from __future__ import annotations

import statistics
from typing import Callable

from ..runtime import Event, Stream


def median_ms(fn: Callable[[Stream], None], stream: Stream, warmup: int = 5, repeat: int = 30) -> float:
    """Median wall time on the device of fn(stream), in milliseconds."""
    for _ in range(warmup):
        fn(stream)
    times = []
    for _ in range(repeat):
        start = Event().record(stream)
        fn(stream)
        end = Event().record(stream)
        times.append(start.elapsed_ms(end))
    return statistics.median(times)
