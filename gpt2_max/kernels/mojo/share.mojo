"""How a kernel's work items are shared among tasks, and what a projection does to its
outputs while they are in cache.

A kernel cuts its weight into chunks and hands them to a `Team` (`share_out`). As an
op of its own, the team is one task per runtime thread, started by the kernel
(`Team.launch`). Inside a fused op (`block.mojo`, a whole GPT-2 block) the tasks are
already running, one stage after another: each calls the stage's kernel as a member
of the team (`Team.joined`), claims chunks from counters the stage's tasks share, and
meets the others at the op's barrier after it. So a block's packed projections run
the same kernels as the packed ops, without one op boundary each.

An `Epilogue` is applied to each chunk of outputs right after it is summed: a residual
added, or GELU, as the block's stages need, where a second pass over the output would
read it back from memory.
"""

from std.atomic import Atomic
from std.math import ceildiv, tanh
from std.sys import CompilationTarget, simd_width_of

from max.algorithm import sync_parallelize
from max.gpu.host.device_context import DeviceContextBase

comptime CpuCtx = DeviceContextBase[CompilationTarget()]
comptime F32Ptr = UnsafePointer[Float32, MutUntrackedOrigin]
comptime MC = 64
"""Input rows per pass over a weight: many rows (a prefill) are taken this many at a
time, so they stay in L2 while the weight streams past once per pass; a work item is
one chunk in one pass."""
comptime SW = simd_width_of[DType.float32]()
comptime Counters = UnsafePointer[Atomic[Int64], MutUntrackedOrigin]
comptime GELU_C = 0.7978845608028654
"""sqrt(2 / pi)."""


@fieldwise_init
struct Team(ImplicitlyCopyable, Movable):
    """The tasks that run a kernel's items: `ntasks` started on `ctx` by the kernel, or
    (`member` set) task `member` of `ntasks` already running, claiming items from
    `counters` (a band's counter every `stride`), which every member of the stage shares
    and which start at zero."""

    var ntasks: Int
    var ctx: Optional[CpuCtx]
    var member: Optional[Int]
    var counters: Optional[Counters]
    var stride: Int

    @staticmethod
    def launch(ntasks: Int, ctx: Optional[CpuCtx]) -> Team:
        return Team(max(1, ntasks), ctx, None, None, 1)

    @staticmethod
    def joined(t: Int, ntasks: Int, counters: Counters, stride: Int) -> Team:
        return Team(ntasks, None, t, counters, stride)

    def starts(self) -> Int:
        """Tasks a kernel may start for work of its own outside the items (rounding a
        prefill's x): the team's where the kernel starts them, none (1) where they
        already run it."""
        return 1 if self.member else self.ntasks


def share_out[Work: def(Int) -> None](work: Work, items: Int, team: Team) raises:
    """Runs `work(0)` ... `work(items - 1)` on the team's tasks.

    Task `t` takes the items of its own band (the `t`-th of equal ranges) in order, so
    each streams a contiguous range of the weights as with a fixed split; a task done
    with its band then takes what is left of the others', so one that streams slower,
    or loses its core for a while, hands the rest of its band over. Each band's next
    item comes from an atomic counter of its own, so every item runs once.
    """
    if team.member:
        take_share(work, items, team.member.value(), team.ntasks, team.counters.value(), team.stride)
        return
    var tasks = max(1, min(team.ntasks, items))
    var taken = alloc[Int64](tasks)
    for t in range(tasks):
        taken.unsafe_store(t, 0)
    var counters = taken.unsafe_bitcast[Atomic[Int64]]()

    def task(t: Int) {imm work, imm items, imm tasks, imm counters}:
        take_share(work, items, t, tasks, counters, 1)

    sync_parallelize(task, tasks, team.ctx)
    taken.free()


@always_inline
def take_share[Work: def(Int) -> None](
    work: Work, items: Int, t: Int, T: Int, counters: Counters, stride: Int
):
    """Task `t`'s part of `share_out`'s items: its own band in order, then what is left
    of the others' (`counters[band * stride]` counts a band's taken items)."""
    for k in range(T):
        var band = (t + k) % T
        var first = band * items // T
        var size = (band + 1) * items // T - first
        while True:
            var i = Int(counters[band * stride].fetch_add(1))
            if i >= size:
                break
            work(first + i)


def share_passes[Work: def(Int, Int, Int) -> None](
    work: Work, M: Int, nchunks: Int, team: Team
) raises:
    """`work(m_begin, m_end, chunk)` for every chunk of a weight and every pass of up to
    `MC` input rows, one item per chunk and pass, shared out by `share_out`."""

    def item(i: Int) {imm work, imm M, imm nchunks}:
        var m0 = i // nchunks * MC
        work(m0, min(m0 + MC, M), i % nchunks)

    share_out(item, nchunks * ceildiv(M, MC), team)


@always_inline
def gelu[w: Int](x: SIMD[DType.float32, w]) -> SIMD[DType.float32, w]:
    """GELU, tanh approximation (GPT-2's `gelu_new`)."""
    return 0.5 * x * (1 + tanh(GELU_C * (x + 0.044715 * x * x * x)))


@always_inline
def gelu_in_place(row: F32Ptr, n0: Int, n1: Int):
    var n = n0
    while n + SW <= n1:
        row.unsafe_store(n, gelu(row.unsafe_load[width=SW](n)))
        n += SW
    for i in range(n, n1):
        row.unsafe_store(i, gelu[1](row.unsafe_load(i)))


@always_inline
def add_into(row: F32Ptr, other: F32Ptr, n0: Int, n1: Int):
    var n = n0
    while n + SW <= n1:
        row.unsafe_store(n, row.unsafe_load[width=SW](n) + other.unsafe_load[width=SW](n))
        n += SW
    for i in range(n, n1):
        row.unsafe_store(i, row.unsafe_load(i) + other.unsafe_load(i))


@fieldwise_init
struct Epilogue(ImplicitlyCopyable, Movable):
    """What a projection does to its outputs once summed: nothing, `+ residual` (an
    `[M, N]` array like the output), or GELU (`gelu`)."""

    var residual: Optional[F32Ptr]
    var gelu: Bool

    @staticmethod
    def none() -> Epilogue:
        return Epilogue(None, False)

    @staticmethod
    def add(residual: F32Ptr) -> Epilogue:
        return Epilogue(residual, False)

    @staticmethod
    def gelu_tanh() -> Epilogue:
        return Epilogue(None, True)

    @always_inline
    def apply(self, y: F32Ptr, N: Int, m0: Int, m1: Int, n0: Int, n1: Int):
        """Over rows `m0 : m1` and columns `n0 : n1` of `y` (`[M, N]`)."""
        for m in range(m0, m1):
            if self.residual:
                add_into(y + m * N, self.residual.value() + m * N, n0, n1)
            elif self.gelu:
                gelu_in_place(y + m * N, n0, n1)
