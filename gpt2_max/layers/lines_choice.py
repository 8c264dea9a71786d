"""Whether a one-op block's float16 weights are held in lines on this CPU: timed once
per CPU, then read from MAX's cache, as the packed kernels are (`kernel_choice`).

In lines (`kernels.lines`) a block of four weight rows is one sequential stream
instead of four strided ones. Whether two cores stream that faster depends on the
machine, and by much: the same op is faster in lines on one CPU this project measured
and slower on another (`docs/performance.md`, "Float16 in lines"). So the layout is a
measurement, not a table or a vendor check. The first load of float16 weights that a
`FusedBlock` would read times a chain of GPT-2's MLP projections in float16 at one row
(a decode step, what a lone request waits on), each layout in turn, and holds the
weights in lines only where that is faster by more than `MARGIN`; otherwise they stay
row-major, as the file has them, which costs no copy. The chain runs the same kernel
the block's op runs on its projections, and its outputs are the same in either layout.

`GPT2_MAX_FLOAT16_LINES=1` or `=0` names one instead (tests and benchmarks that
compare them).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops

from .. import kernels
from ..names import PACKAGE
from ..settings import setting, settings
from ..weights.hugepages import hugepage_array
from .kernel_choice import FF, LAYERS, D, alternated, kept

logger = logging.getLogger("max.pipelines")

LINES_ENV = setting("float16_lines").variable
KEY = "float16 lines"
"""The measurement's entry in the kernel choices' cache file (`kernel_choice.cache_file`)."""
MARGIN = 1.03
"""How much faster lines must stream to be taken: where the two are level, row-major
keeps the file's layout and the memory a copy would take at load."""
LAYOUTS = ("rows", "lines")


@dataclass(frozen=True)
class Layout:
    lines: bool
    ms: dict[str, float] = field(default_factory=dict)
    """Per layout (`LAYOUTS`), the chain's median milliseconds at one row."""
    why: str = ""
    busy: float = 0.0
    """The share of the CPU's time that other processes took while the chains ran."""


def float16_lines() -> bool:
    """Whether a `FusedBlock`'s float16 weights are held in lines on this CPU."""
    return layout().lines


@functools.cache
def layout() -> Layout:
    """Named by `GPT2_MAX_FLOAT16_LINES`, else as measured on this CPU (measured now if
    it never was)."""
    if (named := settings().float16_lines) is not None:
        return Layout(named, why=f"{LINES_ENV}={int(named)}")
    picked = kept(KEY, "float16 weights row-major and in lines", measure, Layout)
    held = "in lines" if picked.lines else "row-major"
    logger.info(f"{PACKAGE}: a one-op block's float16 weights {held} ({picked.why})")
    return picked


def measure(*, rounds: int = 3) -> Layout:
    """Times `LAYERS` MLP pairs of random float16 weights at one row, row-major and in
    lines in turn, and picks by `pick`."""
    rng = np.random.default_rng(0)
    pair = [(rng.standard_normal(s, dtype=np.float32) / np.sqrt(s[1])).astype(np.float16)
            for s in ((FF, D), (D, FF))]
    weights = [pair[i % 2] for i in range(2 * LAYERS)]
    session = InferenceSession(devices=[CPU()])
    x = Buffer.from_numpy(rng.standard_normal((1, D), dtype=np.float32))
    models, inputs = {}, {}
    for name in LAYOUTS:
        lined = name == "lines"
        models[name] = session.load(chain(lined))
        inputs[name] = [x, *(Buffer.from_numpy(held(w, lined)) for w in weights)]
    ms, busy = alternated({name: (models[name], inputs[name], 8) for name in LAYOUTS}, rounds)
    return pick(ms, busy)


def pick(ms: dict[str, float], busy: float = 0.0) -> Layout:
    """Lines where their chain is faster than row-major's by more than `MARGIN`."""
    lines = ms["lines"] * MARGIN < ms["rows"]
    why = (f"measured: {LAYERS} float16 MLPs at one row {ms['rows']:.2f} ms row-major, "
           f"{ms['lines']:.2f} ms in lines: {'lines' if lines else 'row-major'} kept")
    return Layout(lines, ms, why, busy)


def held(weight: np.ndarray, lined: bool) -> np.ndarray:
    """`weight` as a `FusedBlock` holds it (`FastLayers.prepare`): in huge pages, and in
    lines where `lined`."""
    return hugepage_array(kernels.lines(weight) if lined else weight)


def chain(lined: bool) -> Graph:
    """`LAYERS` float16 MLP pairs (no GELU: the arithmetic is not what is timed)
    multiplied one after another into x (`[rows, D]`), weights in lines where `lined`,
    by the skinny kernel that a `FusedBlock`'s op runs on its projections."""
    cpu = DeviceRef.CPU()
    types = [TensorType(DType.float32, ["rows", D], cpu)]
    types += [TensorType(DType.float16, list(s), cpu) for _ in range(LAYERS)
              for s in ((FF, D), (D, FF))]
    with Graph(f"{PACKAGE}_float16_{'lines' if lined else 'rows'}", input_types=types) as graph:
        x = graph.inputs[0].tensor
        zeros = {n: ops.constant(np.zeros(n, np.float32), DType.float32, cpu) for n in (D, FF)}
        for w in graph.inputs[1:]:
            x = kernels.skinny_linear(x, w.tensor, zeros[int(w.tensor.shape[0])], lined=lined)
        graph.output(x)
    return graph
