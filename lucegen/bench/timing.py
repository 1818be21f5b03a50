"""Device-event timing: warm up long enough for the clocks to settle, repeat, take the median; and each kernel of a
sequence of launches timed one by one (launch_times), grouped by kind (by_kind) and recorded so (record_kinds)."""
from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Iterable

from ..runtime import Event, Graph, Stream, observe_launches

QUEUED_MS = 200.0  # graph replays queued ahead of an eager pass timed kernel by kernel
_SHAPE_PART = re.compile(r"(wg|wt)?\d+x\d+|[hkmrst]\d+|st\d+|mb\d+")  # the parts of a kernel name that name a shape
                                                                          # or a tuning (mb: a blocks-an-SM floor)


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


def host_median_ms(fn: Callable[[], object], repeat: int, warmup: int = 0) -> float:
    """Median host time of fn() in milliseconds (fn waits for any device work it starts), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_kind(name: str) -> str:
    """A kernel's kind: its name without the parts that name a shape (gemm_wg128x256_silu -> gemm_silu,
    rmsnorm_f32_h1024 -> rmsnorm_f32, qgemv_q4_k_k5120_r1_s2_t256_st3 -> qgemv_q4_k, qgemm_m8_q6_k_k5120_r1_s1_t256
    -> qgemm_q6_k, qgemm_mma_m16_r1_q4_k_k5120_t256_st3 -> qgemm_mma_q4_k)."""
    return "_".join(p for p in name.split("_") if not _SHAPE_PART.fullmatch(p))


def queued_replays(graph_ms: float) -> int:
    """How many replays of a graph of graph_ms launch_times queues ahead of its eager pass."""
    return math.ceil(QUEUED_MS / graph_ms)


def launch_times(enqueue: Callable[[Stream], None], graph: Graph, graph_ms: float,
                 stream: Stream) -> list[tuple[str, tuple, float]]:
    """(kernel name, launch args, device microseconds) of every launch of one eager enqueue(stream), in launch order,
    each kernel between an event pair. The pass is enqueued behind queued_replays(graph_ms) replays of `graph` (the
    same work captured, graph_ms each), so the host's launches stay ahead of the device: no kernel waits for its
    launch and each event pair times one kernel rather than a launch gap."""
    for _ in range(queued_replays(graph_ms)):
        graph.launch(stream)
    marks = []

    def timed(kernel, args, s, launch):
        start = Event().record(s)
        launch()
        marks.append((kernel.name, args, start, Event().record(s)))

    with observe_launches(timed):
        enqueue(stream)
    stream.synchronize()
    out = []
    for name, args, start, end in marks:
        out.append((name, args, start.elapsed_ms(end) * 1e3))
        start.destroy(), end.destroy()
    return out


def by_kind(launches: Iterable[tuple[str, tuple, float]],
            flops: Callable[[str, tuple], float] = lambda name, args: 0.0) -> dict[str, list]:
    """{kernel_kind: [microseconds, launches, FLOPs]} of launch_times' list, in order of first launch; flops(name,
    args): a launch's FLOPs (none by default)."""
    kinds: dict[str, list] = {}
    for name, args, us in launches:
        k = kinds.setdefault(kernel_kind(name), [0.0, 0, 0.0])
        k[0] += us
        k[1] += 1
        k[2] += flops(name, args)
    return kinds


def record_kinds(rec, metric: str, model: str, launches: list[tuple[str, tuple, float]], title: str, note: str,
                 **extra) -> None:
    """Print launch_times' list per kernel kind, longest first (launches, microseconds, share), under "<title>
    kernel by kernel (<their sum> us timed one by one, <note>)", and record each kind as <metric>_<kind> in
    microseconds, with `extra`."""
    kinds = sorted(by_kind(launches).items(), key=lambda kv: -kv[1][0])
    total = sum(us for _, (us, _, _) in kinds)
    print(f"  {title} kernel by kernel ({total:.0f} us timed one by one, {note}):")
    for kind, (us, n, _) in kinds:
        print(f"    {kind:<28} {n:>5} launches {us:>9.1f} us {us / total:>6.1%}")
        rec.record(f"{metric}_{kind}", model, us, "us", None, **extra, launches=n, share=round(us / total, 3))
