"""What an op boundary costs a decode step under MAX: the same bytes of float32
projections at one row, cut into more ops.

Three graphs multiply one row through random `[N, 768]` weights (huge-page
memory, the package's skinny op, the model's runtime policy), each op's output
sliced to the next one's input as the model's chain does: 48 ops of 3072 rows,
96 of 1536 and 192 of 768, the same 453 MB. If an op boundary cost nothing, the
three would take the same time, as they do in `gemv_ceiling.c`'s C loop. The
graphs run in one process, alternating, and each figure is a median.

    PYTHONPATH=. python benchmarks/bench_op_boundaries.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from bench_start import cpu_model
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

from gpt2_max import kernels
from gpt2_max.cpu_runtime import threads
from gpt2_max.weights.hugepages import hugepage_array

WIDTH = 768
CUTS = [(48, 3072), (96, 1536), (192, 768)]
"""(ops, rows of each weight): the same bytes each."""


def chain(session: InferenceSession, ops: int, rows: int) -> tuple:
    rng = np.random.default_rng(ops)
    arrays = [np.zeros((1, WIDTH), np.float32)] + [
        hugepage_array(rng.standard_normal((rows, WIDTH), np.float32) / WIDTH)
        for _ in range(ops)
    ]
    types = [TensorType(DType.float32, list(a.shape), DeviceRef.CPU()) for a in arrays]
    with Graph(f"chain_{ops}", input_types=types) as graph:
        inputs = iter(v.tensor for v in graph.inputs)
        x = next(inputs)
        for _ in range(ops):
            x = kernels.skinny_matmul(x, next(inputs))[:, :WIDTH]
        graph.output(x)
    model = session.load(graph)
    buffers = [Buffer.from_numpy(a) for a in arrays]
    model.execute(*buffers)
    return model, buffers


def main() -> None:
    before = threads.thread_ids()
    session = InferenceSession(devices=[CPU()])
    graphs = {cut: chain(session, *cut) for cut in CUTS}
    threads.yield_to_main_thread()
    threads.idle_engine_poller(before)
    times: dict[tuple[int, int], list[float]] = {cut: [] for cut in CUTS}
    for _ in range(4):
        for cut, (model, buffers) in graphs.items():
            for _ in range(5):
                model.execute(*buffers)
            for _ in range(60):
                start = time.perf_counter()
                model.execute(*buffers)
                times[cut].append(time.perf_counter() - start)
    mb = CUTS[0][0] * CUTS[0][1] * WIDTH * 4 / 1e6
    print(f"CPU: {cpu_model()}; {mb:.0f} MB of float32 weights at one row; median ms")
    print("| ops | rows each | ms | GB/s |\n| ---: | ---: | ---: | ---: |")
    for (ops, rows), samples in times.items():
        ms = statistics.median(samples) * 1e3
        print(f"| {ops} | {rows} | {ms:.2f} | {mb / ms:.1f} |")


if __name__ == "__main__":
    main()
