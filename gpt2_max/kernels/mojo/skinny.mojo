"""Skinny matmul for decode steps: y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]), CPU.

`x`, `b` and `y` are float32; `w` is float32 or float16. A float16 `w` is widened
to float32 in registers as it is loaded, so a step reads half the bytes and still
accumulates in float32.

A decode step multiplies a handful of rows by every weight matrix once, so its cost is
streaming the weights from memory. `w` is read exactly once, in chunks of
`CHUNK_BLOCKS` blocks of `R` rows: for every block, all `M` input rows are
multiplied in tiles of up to `MT` rows while the block is still in L1, a cache line
of each row per iteration (as many SIMD loads as a line holds of `w`'s type).

The tasks (one per runtime thread) each stream a band of chunks, then take what is
left of the others' bands (`share.share_out`): an op ends when its last task does, and a
thread that streams slower, or loses its core for a while to another process (the
API process of a served model), would otherwise hold the whole step up; the others
take over the rest of its band, while each task still reads one contiguous range
when nothing gets in the way.

A float16 weight can be held in lines (`lines`, `kernels.lines`): each block of `R` rows
stored a cache line of each row in turn, so a block is one sequential stream instead of
`R` strided ones, which two cores streaming at once read faster where rows are short
(`docs/performance.md`, "Float16 in lines"). The rows past the last whole block stay
row-major. Each row's values are summed in the same order either way, so the outputs
are the same bit for bit.

That order is the fastest at a few rows and not at many, where reusing each loaded
weight across rows matters more than streaming: the ops in `ops.mojo` hand float32
steps of more rows than their `max_rows` to MAX's tiled matmul instead, so many rows
reach this kernel only through float16 weights, which MAX's matmul cannot take.
"""

from std.math import ceildiv, fma
from std.sys import simd_width_of, size_of
from std.sys.intrinsics import PrefetchOptions, prefetch

from .share import CpuCtx, F32Ptr, Team, share_passes

comptime WPtr[wdt: DType] = UnsafePointer[Scalar[wdt], MutUntrackedOrigin]
comptime SW = simd_width_of[DType.float32]()
comptime LINE = 64
"""Bytes of a cache line."""
comptime R = 4
"""Weight rows per block: R independent streams per task."""
comptime MT = 4
"""Input rows per register tile: MT * R accumulators."""
comptime CHUNK_BLOCKS = 16
"""Blocks per chunk, the unit the tasks take from their bands' counters: a few
microseconds of streaming, short enough to share a small projection out evenly, long
enough that taking one costs nothing beside it (`docs/performance.md`, "How a kernel's tasks share the rows")."""
comptime CHUNK_ROWS = CHUNK_BLOCKS * R
"""Weight rows per chunk."""
comptime LINES_AHEAD = 1024
"""Bytes ahead of a block in lines that its stream requests (one request a line)."""


@always_inline
def _tile[wdt: DType, mt: Int, r: Int, ahead: Int, lines: Bool](
    x: F32Ptr, w: WPtr[wdt], b: F32Ptr, y: F32Ptr,
    K: Int, N: Int, m0: Int, n0: Int, has_bias: Bool,
):
    """y[m0 : m0+mt, n0 : n0+r], accumulated in SIMD lanes, reduced once at the end.

    Requests the next block's rows whose bits are set in `ahead` (`_tile_ahead`); in
    lines (`lines` and a whole block, K a multiple of a line's values), a lone tile
    (all four bits) the lines `LINES_AHEAD` bytes on instead."""
    comptime u = max(1, LINE // (SW * size_of[wdt]()))
    """SIMD loads per weight row per iteration: one cache line of each row."""
    comptime in_lines = lines and r == R
    comptime lw = line_values[wdt]()
    """Values of one row in a line (`SW * u`)."""
    var acc = Array[SIMD[DType.float32, SW], mt * r](fill=0)
    var kl = (K // (SW * u)) * (SW * u)
    var kv = (K // SW) * SW
    var k = 0
    while k < kl:
        comptime for j in range(r):
            comptime if ahead & (1 << j):
                comptime if in_lines and ahead == 0b1111:
                    # A lone tile streams its block: the lines a little way on.
                    prefetch[PrefetchOptions().for_read().medium_locality()](
                        w + n0 * K + k * r + j * lw + LINES_AHEAD // size_of[wdt]()
                    )
                elif in_lines:
                    # Tiles sharing a block: its first tile streams it, so each asks for
                    # its share of the next block's lines at the same place.
                    prefetch[PrefetchOptions().for_read().medium_locality()](
                        w + (n0 + r) * K + k * r + j * lw
                    )
                else:
                    # The next block's rows, one block ahead: turns r short streams into
                    # one long one.
                    prefetch[PrefetchOptions().for_read().medium_locality()](w + (n0 + r + j) * K + k)
        comptime for v in range(u):
            var ws = Array[SIMD[DType.float32, SW], r](fill=0)
            comptime for j in range(r):
                comptime if in_lines:
                    ws[j] = w.unsafe_load[width=SW](n0 * K + k * r + j * lw + v * SW).cast[DType.float32]()
                else:
                    ws[j] = w.unsafe_load[width=SW]((n0 + j) * K + k + v * SW).cast[DType.float32]()
            comptime for i in range(mt):
                var xv = x.unsafe_load[width=SW]((m0 + i) * K + k + v * SW)
                comptime for j in range(r):
                    acc[i * r + j] = fma(ws[j], xv, acc[i * r + j])
        k += SW * u
    while k < kv:
        comptime for j in range(r):
            var wv = w.unsafe_load[width=SW]((n0 + j) * K + k).cast[DType.float32]()
            comptime for i in range(mt):
                var xv = x.unsafe_load[width=SW]((m0 + i) * K + k)
                acc[i * r + j] = fma(wv, xv, acc[i * r + j])
        k += SW
    comptime for i in range(mt):
        comptime for j in range(r):
            var s = acc[i * r + j].reduce_add()
            for kk in range(kv, K):
                var wk = w.unsafe_load((n0 + j) * K + kk).cast[DType.float32]()
                s += wk * x.unsafe_load((m0 + i) * K + kk)
            if has_bias:
                s += b.unsafe_load(n0 + j)
            y.unsafe_store((m0 + i) * N + n0 + j, s)


@always_inline
def _block[wdt: DType, r: Int, lines: Bool = False](
    x: F32Ptr, w: WPtr[wdt], b: F32Ptr, y: F32Ptr,
    M: Int, K: Int, N: Int, n0: Int, has_bias: Bool,
):
    """All M rows against weight rows n0 : n0+r, in tiles of up to `MT` rows.

    The tiles share out the requests for the next block's rows (`_tile_ahead`): past `MT`
    rows a block is multiplied from cache once per tile, and if the first tile requested
    the whole next block the memory would idle through the others."""
    var tiles = ceildiv(M, MT)
    var m0 = 0
    var t = 0
    while m0 + MT <= M:
        _tile_ahead[wdt, MT, r, lines](x, w, b, y, K, N, m0, n0, has_bias, t, tiles)
        m0 += MT
        t += 1
    comptime for rest in range(1, MT):
        if M - m0 == rest:
            _tile_ahead[wdt, rest, r, lines](x, w, b, y, K, N, m0, n0, has_bias, t, tiles)


@always_inline
def _tile_ahead[wdt: DType, mt: Int, r: Int, lines: Bool](
    x: F32Ptr, w: WPtr[wdt], b: F32Ptr, y: F32Ptr,
    K: Int, N: Int, m0: Int, n0: Int, has_bias: Bool, t: Int, tiles: Int,
):
    """`_tile` requesting its share of the next block's rows, so every tile of a block
    streams part of the next one: the masks are written for `R` = 4 rows (one tile
    requests all four, two tiles two each, three tiles 2 + 1 + 1, four or more tiles one
    each and the rest none)."""
    if tiles == 1:
        _tile[wdt, mt, r, 0b1111, lines](x, w, b, y, K, N, m0, n0, has_bias)
    elif tiles == 2:
        if t == 0:
            _tile[wdt, mt, r, 0b0101, lines](x, w, b, y, K, N, m0, n0, has_bias)
        else:
            _tile[wdt, mt, r, 0b1010, lines](x, w, b, y, K, N, m0, n0, has_bias)
    elif tiles == 3 and t == 0:
        _tile[wdt, mt, r, 0b1001, lines](x, w, b, y, K, N, m0, n0, has_bias)
    elif t == 0:
        _tile[wdt, mt, r, 0b0001, lines](x, w, b, y, K, N, m0, n0, has_bias)
    elif t == 1:
        _tile[wdt, mt, r, 0b0010, lines](x, w, b, y, K, N, m0, n0, has_bias)
    elif t == 2:
        _tile[wdt, mt, r, 0b0100, lines](x, w, b, y, K, N, m0, n0, has_bias)
    elif t == 3:
        _tile[wdt, mt, r, 0b1000, lines](x, w, b, y, K, N, m0, n0, has_bias)
    else:
        _tile[wdt, mt, r, 0, lines](x, w, b, y, K, N, m0, n0, has_bias)


def line_values[wdt: DType]() -> Int:
    """Values of one weight row in a line, the unit of a layout in lines."""
    return SW * max(1, LINE // (SW * size_of[wdt]()))


def skinny_matmul[wdt: DType, lines: Bool = False](
    x: F32Ptr, w: WPtr[wdt], b: F32Ptr, y: F32Ptr,
    M: Int, K: Int, N: Int, has_bias: Bool, ntasks: Int, ctx: Optional[CpuCtx],
) raises:
    comptime if lines:
        if K % line_values[wdt]():
            raise Error("weights in lines need rows of a multiple of ", line_values[wdt](),
                        " values, not ", K)
    var nblocks = N // R
    var nchunks = max(1, ceildiv(nblocks, CHUNK_BLOCKS))

    def chunk(m_begin: Int, m_end: Int, c: Int) {imm x, imm w, imm b, imm y, imm K, imm N, imm has_bias, imm nblocks, imm nchunks}:
        var xm = x + m_begin * K
        var ym = y + m_begin * N
        var mc = m_end - m_begin
        for blk in range(c * CHUNK_BLOCKS, min((c + 1) * CHUNK_BLOCKS, nblocks)):
            _block[wdt, R, lines](xm, w, b, ym, mc, K, N, blk * R, has_bias)
        if c == nchunks - 1:
            for n in range(nblocks * R, N):
                _block[wdt, 1](xm, w, b, ym, mc, K, N, n, has_bias)

    share_passes(chunk, M, nchunks, Team.launch(ntasks, ctx))
