"""Device-event timing: warm up long enough for the clocks to settle, repeat, take the median."""
from __future__ import annotations

import statistics
import time
from typing import Callable

from ..runtime import Event, Stream


def median_ms(fn: Callable[[Stream], None], stream: Stream, warmup_s: float = 0.3, repeat: int = 30) -> float:
    """Median device time of fn(stream) in milliseconds, after running it for `warmup_s` seconds."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup_s:
        fn(stream)
        stream.synchronize()
    times = []
    for _ in range(repeat):
        start = Event().record(stream)
        fn(stream)
        end = Event().record(stream)
        times.append(start.elapsed_ms(end))
    return statistics.median(times)
