"""Which kernel multiplies a packed block type on this CPU, MAX's or the package's:
timed once per CPU, then read from MAX's cache.

MAX's `qmatmul` (`qmatmul.py`) covers Q4_0, Q4_K and Q6_K; the package's
(`kernels/mojo/kquant.mojo`) every packed type. Which of the two is faster depends
on the machine more than on the format (the AMD EPYCs of this project's machines
disagree with each other and with the Intel Xeons: `docs/performance.md`, "Packed
kernels per CPU"), so the choice is a measurement, not a table or a vendor check.
The first load of such a type on a CPU times both on a chain of GPT-2's MLP
projections (weights past the L3, as a model's are), at one row (a decode step) and
at `PREFILL_ROWS` (a prefill chunk), and keeps the kernel that serves a request of
`REQUEST` tokens sooner by more than `MARGIN` (`pick`). Where the two serve it
within the margin, a level the timing noise of one start cannot order, the faster
decode step decides: a stream's steps after its prefill are decode steps, one row
each, and those are what a lone request waits on; where that is level too, MAX's
keeps the type. The result is kept in MAX's cache, keyed by the CPU, MAX's version
and the kernels' sources; later starts, and the other processes of a server, read it.

One kernel serves every row count of a weight, so a row's product does not depend on
the rows beside it (the attention's key shares still do: `docs/gguf.md`). A weight
that only ever multiplies a few rows takes the kernel with the faster decode step of
the same measurement (`Choice.kernel_for`, "decode"): a speculative draft's
(`speculate/draft.py`), which multiplies one row a step, and the LM head of a model
returning last-token logits, which multiplies each sequence's last rows alone, at a
prefill as at a decode step (`WeightPlan.work_of`).
A block whose projections are all packed runs as one op on the package's kernel
(`layers.fast.FusedBlock`, "block") unless MAX's is faster by `MARGIN` at the block's
work (`Choice.one_op`: a served model's request, a draft's decode step). Inside the
op its projections are not ops of their own, so they do not pay what cutting a
one-row stream into one more op costs beyond its bytes: the same measurement times
the package's chain cut into twice the ops, and the difference per op
(`Choice.op_ms`) is taken off the package's side. A CPU where MAX's kernel streams a
little faster still runs its blocks as one op, and only one where it is faster by
more than those boundaries composes them.

A measurement is only as good as the CPU it had: one taken while other processes
kept the cores busy (a second server starting, a test run beside it) can pick the
slower kernel, and a kept choice would slow every later start. So `measure` notes
the share of the CPU's time other processes took while it timed (`Choice.busy`), and
a choice measured at more than `BUSY_LIMIT` serves this start only, with a warning;
the next start measures again.

`GPT2_MAX_PACKED_KERNEL=max` or `=package` names one instead (tests and benchmarks
that compare them).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import psutil
from gguf import GGMLQuantizationType
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

from .. import kernels
from ..encodings import BLOCK_FLAGS, KERNEL_TYPES
from ..kernels.package import source_hash
from ..max_cache import max_cache_dir
from ..names import PACKAGE
from ..settings import setting, settings
from ..weights.hugepages import hugepage_array
from . import qmatmul

logger = logging.getLogger("max.pipelines")

KERNEL_ENV = setting("packed_kernel").variable
KERNELS = ("max", "package")
PREFILL_ROWS = 64
REQUEST = (900, 128)
"""(prompt, generated) tokens of the request the two kernels are weighed on: the
prefill and decode shapes of the benchmarks' targets (pp900, tg128)."""
MARGIN = 1.1
WORK = ("request", "decode", "block")
"""What a kernel is chosen for: a served model's requests (`REQUEST`'s decode steps and
prefill chunks), a few rows a step alone (a draft's weights, a last-token head), or a
block's projections where the block runs as one op (`layers.fast.FusedBlock`, the
package's kernel inside it: `one_op`)."""
CUT = "cut"
"""The package's chain with each projection cut in two (the same bytes in twice the ops),
timed at one row beside the others: what an op's boundary costs (`Choice.op_ms`)."""
FORMAT = 2
"""The measurement's version, part of the cache's key: choices a former one kept (without
`Choice.op_ms`) are measured again."""
BUSY_LIMIT = 0.1
"""The share of the CPU's time other processes may take while `measure` times, for its
choice to be kept (`Choice.busy`)."""
LAYERS = 24
"""(768 -> 3072 -> 768) pairs timed: 64 MB of Q4_K, past a 32 MiB L3."""
CHAIN_OPS = 2 * LAYERS
"""The ops of a chain timed, one a projection."""
D, FF = 768, 3072


@dataclass(frozen=True)
class Choice:
    kernel: str
    """"max" or "package"."""
    ms: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per kernel, the chain's median milliseconds at "decode" and "prefill" rows."""
    why: str = ""
    busy: float = 0.0
    """The share of the CPU's time that other processes took while the chains ran."""
    op_ms: float = 0.0
    """What one more op of the package's kernel costs a one-row chain, milliseconds: the
    cut chain's time (`CUT`) less the whole one's, per op it adds; 0 where that is not
    less than a whole op's time (a measurement broken by noise, which must not make
    the package's projections free)."""

    def kernel_for(self, work: str) -> str:
        """The kernel for `work` (`WORK`): the request's choice; for "decode" the faster
        decode step by `MARGIN`; for "block" the package's, whose op the block is (a
        named kernel for all three)."""
        if work == "request" or not self.ms:
            return self.kernel
        if work == "block":
            return "package"
        return decode_kernel(self.ms)

    def one_op(self, work: str) -> bool:
        """Whether a block whose packed weights are this type runs as one op on the
        package's kernel, rather than composed of its ops on MAX's, for `work`'s steps
        ("request": `REQUEST`'s; "decode": a draft's one-row steps alone): unless MAX's
        kernel is faster at them by `MARGIN` than the package's inside the op
        (`in_block`), whose projections are not ops of their own (`docs/performance.md`,
        "One op a block")."""
        if not self.ms:
            return self.kernel == "package"
        inside = self.in_block()
        if work == "decode":
            return not faster(self.ms["max"]["decode"], inside["decode"])
        return not faster(request_cost(self.ms["max"]), request_cost(inside))

    def in_block(self) -> dict[str, float]:
        """The package's chain times without its ops' boundaries at one row (`op_ms` each),
        as its projections run inside a one-op block; a prefill's are kept whole, the
        boundaries being a small part of a 64-row op's time."""
        package = self.ms["package"]
        return package | {"decode": package["decode"] - CHAIN_OPS * self.op_ms}

    def describe(self, encoding: str, work: str = "request") -> str:
        if work == "block":
            boundaries = (f" (an op's boundary {self.op_ms * 1e3:.0f} us a one-row step, "
                          "which its projections do not pay)" if self.ms else "")
            return (f"{encoding} weights of a block: one op, the package's kernel inside "
                    f"it{boundaries}")
        if work == "request" or not self.ms:
            return f"{encoding} weights: {self.kernel}'s kernel ({self.why})"
        ms = {k: m["decode"] for k, m in self.ms.items()}
        return (f"{encoding} weights, few rows a step: {self.kernel_for(work)}'s kernel "
                f"(decode step {ms['max']:.2f} ms on MAX's, {ms['package']:.2f} on "
                f"{PACKAGE}'s, {LAYERS} MLPs)")


def uses_max_kernel(encoding: str, work: str = "request") -> bool:
    """Whether `encoding`'s packed weights go through MAX's `qmatmul` on this CPU, for
    `work` (`WORK`)."""
    return encoding in BLOCK_FLAGS and choice(encoding).kernel_for(work) == "max"


def one_op(encoding: str, work: str = "request") -> bool:
    """Whether a block's `encoding` weights let it run as one op (`Choice.one_op`): a
    type the package's kernel multiplies, and MAX's, where it has one, not the faster
    at `work`."""
    return encoding in KERNEL_TYPES and (
        encoding not in BLOCK_FLAGS or choice(encoding).one_op(work)
    )


@functools.cache
def choice(encoding: str) -> Choice:
    """The kernel of a type MAX's `qmatmul` covers: named by `GPT2_MAX_PACKED_KERNEL`,
    else as measured on this CPU (measured now if it never was)."""
    if (named := settings().packed_kernel) is not None:
        return Choice(named, why=f"{KERNEL_ENV}={named}")
    picked = kept(encoding, f"MAX's and {PACKAGE}'s kernels for {encoding}",
                  lambda: measure(encoding), Choice)
    logger.info(f"Packed {picked.describe(encoding)}")
    return picked


class Measured(Protocol):
    """What `kept` keeps: a dataclass of this CPU's figures and what they chose."""

    busy: float


M = TypeVar("M", bound=Measured)


def kept(key: str, what: str, measure: Callable[[], M], kind: Callable[..., M]) -> M:
    """`key`'s measurement on this CPU, read from `cache_file`, else taken now (`what`
    names it in the log) and kept there for later starts and the server's other
    processes, unless other processes took more than `BUSY_LIMIT` of the CPU while it
    ran (`OthersBusy`): then it serves this start only. `kind` rebuilds a kept one."""
    path = cache_file()
    known = _read(path)
    if key in known:
        return kind(**known[key])
    logger.info(f"Timing {what} on this CPU (once)")
    measured = measure()
    if measured.busy > BUSY_LIMIT:
        logger.warning(
            f"Other processes took {measured.busy:.0%} of the CPU while {what} were "
            "timed: this start takes the choice, a later start times them again"
        )
        return measured
    known = _read(path) | {key: asdict(measured)}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}")
    staging.write_text(json.dumps(known, indent=1))
    os.replace(staging, path)
    return measured


def cache_file() -> Path:
    """Where this CPU's choices are kept: named by the CPU's model and features, MAX's
    version and the package's kernel sources, so any of them changing measures again."""
    key = "\0".join(
        (cpu_identity(), version("max"), source_hash(kernels.MOJO_PACKAGE), str(FORMAT))
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return max_cache_dir() / PACKAGE / f"packed-kernels-{digest}.json"


def cpu_identity() -> str:
    """The CPU's model name and feature flags (`/proc/cpuinfo`), or what Python knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("vendor_id", "cpu family", "model", "model name", "flags")
    seen = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            seen.setdefault(key.strip(), value.strip())
    return "|".join(f"{k}={seen.get(k, '')}" for k in wanted)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def measure(encoding: str, *, rounds: int = 3) -> Choice:
    """Times both kernels on `LAYERS` MLP pairs of random `encoding` weights and picks
    one by `REQUEST`'s cost (decode steps plus prefill chunks); times the package's on
    the same bytes in twice the ops too (`CUT`: MLPs half as wide), at one row, for
    what an op's boundary costs (`Choice.op_ms`)."""
    # Packed weights come only from GGUF files, so the room that reads them is here
    # whenever this runs; imported here so a copy without it still loads these layers.
    from ..gguf.quants import quantize

    rng = np.random.default_rng(0)
    qtype = GGMLQuantizationType[encoding.upper()]

    def mlps(ff: int, count: int) -> list[np.ndarray]:
        pair = [quantize(rng.standard_normal(s, dtype=np.float32), qtype)
                for s in ((ff, D), (D, ff))]
        return [pair[i % 2].copy() for i in range(2 * count)]

    blocks = mlps(FF, LAYERS)
    weights = {k: held(encoding, k, blocks) for k in KERNELS}
    weights[CUT] = held(encoding, "package", mlps(FF // 2, 2 * LAYERS))
    session = InferenceSession(devices=[CPU()])
    models = {k: session.load(chain(encoding, "max" if k == "max" else "package", w))
              for k, w in weights.items()}
    shapes = {"decode": 1, "prefill": PREFILL_ROWS}
    inputs = {
        (k, s): [Buffer.from_numpy(rng.standard_normal((rows, D), dtype=np.float32))]
        + [Buffer.from_numpy(w) for w in weights[k]]
        for k in weights for s, rows in shapes.items() if k != CUT or s == "decode"
    }
    median, busy = alternated(
        {(k, s): (models[k], buffers, 8 if s == "decode" else 2)
         for (k, s), buffers in inputs.items()},
        rounds,
    )
    ms = {k: {s: median[k, s] for s in shapes} for k in KERNELS}
    added = median[CUT, "decode"] - ms["package"]["decode"]
    op_ms = added / CHAIN_OPS if 0 < added < ms["package"]["decode"] else 0.0
    return replace(pick(ms), busy=busy, op_ms=op_ms)


K = TypeVar("K")


def alternated(runs: dict[K, tuple[Any, list[Buffer], int]], rounds: int
               ) -> tuple[dict[K, float], float]:
    """Each run's median milliseconds: its model executed once untimed, then its count
    of times timed, on its buffers, every round, the runs in turns so drift on a shared
    machine hits all alike; and the share of the CPU's time other processes took while
    they ran (`OthersBusy`)."""
    times: dict[K, list[float]] = {key: [] for key in runs}
    busy = OthersBusy()
    for _ in range(rounds):
        for key, (model, buffers, count) in runs.items():
            model.execute(*buffers)
            for _ in range(count):
                start = time.perf_counter()
                model.execute(*buffers)
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}, busy.share()


class OthersBusy:
    """The share of the CPUs' time, from now to `share()`, that processes other than
    this one kept busy on the CPUs this process may run on (`psutil`'s per-CPU and
    per-process times; a hypervisor's steal counts as busy, as it slows the timing
    alike)."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        try:
            self.cpus = self.process.cpu_affinity()
        except (AttributeError, psutil.Error):  # no affinity on this system
            self.cpus = []
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float, int]:
        per_cpu = psutil.cpu_times(percpu=True)
        if self.cpus and max(self.cpus) < len(per_cpu):
            per_cpu = [per_cpu[i] for i in self.cpus]
        own = self.process.cpu_times()
        busy = sum(_busy_seconds(t) for t in per_cpu)
        return time.monotonic(), busy, own.user + own.system, len(per_cpu)

    def share(self) -> float:
        (t0, busy0, own0, _), (t1, busy1, own1, cpus) = self.start, self._sample()
        capacity = (t1 - t0) * cpus
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / capacity if capacity > 0 else 0.0


def _busy_seconds(times) -> float:
    """A CPU's seconds spent on anything but idling or waiting for I/O (its guest time is
    already counted in user and nice)."""
    idle = sum(getattr(times, f, 0.0) for f in ("idle", "iowait", "guest", "guest_nice"))
    return sum(times) - idle


def request_cost(ms: dict[str, float]) -> float:
    """Milliseconds of `REQUEST` on a kernel whose chain took `ms` ("decode", "prefill")."""
    prompt, generated = REQUEST
    return generated * ms["decode"] + prompt / PREFILL_ROWS * ms["prefill"]


def faster(a: float, b: float) -> bool:
    """Whether `a` milliseconds beat `b` by more than `MARGIN`."""
    return a * MARGIN < b


def decode_kernel(ms: dict[str, dict[str, float]]) -> str:
    """The kernel whose decode step is faster by `MARGIN`, else MAX's."""
    return "package" if faster(ms["package"]["decode"], ms["max"]["decode"]) else "max"


def pick(ms: dict[str, dict[str, float]]) -> Choice:
    """The choice the module's docstring describes, from both kernels' chain times."""
    cost = {k: request_cost(ms[k]) for k in KERNELS}
    step = {k: ms[k]["decode"] for k in KERNELS}
    if faster(cost["package"], cost["max"]) or faster(cost["max"], cost["package"]):
        kernel = min(KERNELS, key=cost.__getitem__)
        reason = "the request sooner"
    else:
        kernel = decode_kernel(ms)
        reason = ("the request level, the decode step faster" if kernel == "package"
                  else "the request and the decode step level, MAX's kept")
    prompt, generated = REQUEST
    why = (f"measured: a {prompt}+{generated}-token request {cost['max']:.0f} ms on MAX's, "
           f"{cost['package']:.0f} ms on {PACKAGE}'s; decode step "
           f"{step['max']:.2f} vs {step['package']:.2f} ms, "
           f"{PREFILL_ROWS}-row prefill {ms['max']['prefill']:.1f} vs "
           f"{ms['package']['prefill']:.1f} ms, {LAYERS} MLPs: {reason}")
    return Choice(kernel, ms, why)


def held(encoding: str, kernel: str, blocks: list[np.ndarray]) -> list[np.ndarray]:
    """GGUF `blocks` of `encoding` laid out as `kernel` reads them: repacked for MAX's
    (`qmatmul.Repacker`), `kernels.interleave`d for the package's; in huge pages, where
    the model keeps them (`quantized.repack`), so both kernels stream aligned rows."""
    if kernel == "max":
        repacker = qmatmul.Repacker({encoding})
        return [hugepage_array(repacker(encoding, b)) for b in blocks]
    return [hugepage_array(kernels.interleave(encoding, b)) for b in blocks]


def chain(encoding: str, kernel: str, weights: list[np.ndarray], *, dot: str = "auto") -> Graph:
    """`weights` (`[out, in]` blocks of `encoding`, as `held` lays them out) multiplied one
    after another into x (`[rows, in]`, any rows), by `kernel` (the package's in its
    arithmetic `dot`, `kernels.DOTS`)."""
    cpu = DeviceRef.CPU()
    types = [TensorType(DType.float32, ["rows", D], cpu)]
    types += [TensorType(DType.uint8, list(w.shape), cpu) for w in weights]
    with Graph(f"{PACKAGE}_{kernel}_{dot}_{encoding}", input_types=types) as graph:
        x = graph.inputs[0].tensor
        for w in graph.inputs[1:]:
            if kernel == "max":
                x = qmatmul.matmul(encoding, x, w.tensor)
            else:
                x = kernels.packed_matmul(encoding, x, w.tensor, dot=dot)
        graph.output(x)
    return graph
