"""Packed-weight matmul for decode steps: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ b[N]).

`W` is a GGUF tensor as the file stores it: row `n` is the `K / QK` blocks of output
feature `n`, `BYTES` bytes each, in ggml's block layout (no repack). `x`, `b` and `y`
are float32, and so is the arithmetic: every weight is decoded to float32 in registers
and multiplied by float32 activations, so the result is the float matmul over the
dequantized weights up to summation order (MAX's and llama.cpp's kernels round the
activations to 8 bits instead).

At a few rows a step costs the bytes of `W`, so the work split follows `skinny.mojo`:
each task owns a contiguous band of weight rows and streams it once; each block is
decoded once per tile of up to `MT` input rows, in groups of 32 weights (two vectors),
and multiplied into `MT * 4` accumulators while its bytes are in L1. Past
`DECODE_ROWS` rows (a prefill) decoding per row tile would repeat M / MT times, so
bands of weight rows are decoded once into float32 and multiplied with `skinny.mojo`'s
register tiles.

Formats (`fmt`, the GGML type id): Q4_0 (2), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14).
"""

from std.math import fma
from std.sys.intrinsics import PrefetchOptions, prefetch

from max.algorithm import sync_parallelize

from .skinny import R as SR
from .skinny import CpuCtx, F32Ptr, _block

comptime U8Ptr = UnsafePointer[UInt8, MutUntrackedOrigin]
comptime V = 16
"""Lanes per decoded vector; a group of 32 weights is two vectors."""
comptime FV = SIMD[DType.float32, V]
comptime MT = 4
"""Input rows per register tile: each decoded group is used MT times."""
comptime MC = 64
"""Prefill: input rows per pass over a decoded band (they stay in L2 meanwhile)."""
comptime DECODE_ROWS = 16
"""Up to this many input rows, weights are decoded in registers per row tile;
beyond it (a prefill), once per band into a float32 buffer."""
comptime BAND = 16
"""Prefill: weight rows decoded together (BAND * K floats, in L2)."""

comptime Q4_0 = 2
comptime Q8_0 = 8
comptime Q4_K = 12
comptime Q5_K = 13
comptime Q6_K = 14


def block_elems[fmt: Int]() -> Int:
    """Weights per block."""
    return 32 if fmt == Q4_0 or fmt == Q8_0 else 256


def block_bytes[fmt: Int]() -> Int:
    """Bytes per block (ggml's block_q4_0, block_q8_0, block_q4_K, block_q5_K, block_q6_K)."""
    comptime if fmt == Q4_0:
        return 18
    elif fmt == Q8_0:
        return 34
    elif fmt == Q4_K:
        return 144
    elif fmt == Q5_K:
        return 176
    else:
        return 210


@always_inline
def _half(p: U8Ptr) -> Float32:
    """The float16 at `p` (2-byte aligned in every block layout), widened."""
    return p.unsafe_bitcast[Float16]().unsafe_load(0).cast[DType.float32]()


@always_inline
def _scale_min_k4(q: U8Ptr, j: Int) -> Tuple[Int, Int]:
    """Sub-block `j`'s 6-bit scale and min from a K-block's 12 packed bytes."""
    if j < 4:
        return (Int(q.unsafe_load(j) & 63), Int(q.unsafe_load(j + 4) & 63))
    var lo = q.unsafe_load(j + 4)
    return (
        Int((lo & 0xF) | ((q.unsafe_load(j - 4) >> 6) << 4)),
        Int((lo >> 4) | ((q.unsafe_load(j) >> 6) << 4)),
    )


@always_inline
def _bytes(p: U8Ptr) -> SIMD[DType.uint8, V]:
    return p.unsafe_load[width=V](0)


@always_inline
def _decode[fmt: Int, g: Int](blk: U8Ptr) -> Tuple[FV, FV]:
    """Weights 32g .. 32g+31 of the block at `blk`, as float32."""
    comptime if fmt == Q4_0:
        # d; 16 bytes: low nibbles are weights 0-15, high nibbles 16-31; value (q - 8) d.
        var d = _half(blk)
        var q = _bytes(blk + 2)
        var lo = (q & 0xF).cast[DType.float32]()
        var hi = (q >> 4).cast[DType.float32]()
        return (fma(lo, FV(d), FV(-8 * d)), fma(hi, FV(d), FV(-8 * d)))
    elif fmt == Q8_0:
        # d; 32 signed bytes; value q d.
        var d = FV(_half(blk))
        var q0 = _bytes(blk + 2).cast[DType.int8]().cast[DType.float32]()
        var q1 = _bytes(blk + 2 + V).cast[DType.int8]().cast[DType.float32]()
        return (q0 * d, q1 * d)
    elif fmt == Q4_K or fmt == Q5_K:
        # d, dmin, 12 bytes of 6-bit scales and mins, [Q5_K: 32 bytes of high bits,]
        # 128 bytes of nibbles: 32 bytes per pair of sub-blocks (low nibble 2c, high 2c+1).
        # value d sc q - dmin m.
        var sm = _scale_min_k4(blk + 4, g)
        var sc = FV(_half(blk) * Float32(sm[0]))
        var mn = FV(-_half(blk + 2) * Float32(sm[1]))
        comptime qoff = 16 if fmt == Q4_K else 48
        comptime shift = 4 * (g % 2)
        var p = blk + qoff + 32 * (g // 2)
        var a = (_bytes(p) >> UInt8(shift)) & 0xF
        var b = (_bytes(p + V) >> UInt8(shift)) & 0xF
        comptime if fmt == Q5_K:
            # Bit g of high byte l is bit 4 of weight l of sub-block g.
            var h = blk + 16
            a = a | (((_bytes(h) >> UInt8(g)) & 1) << 4)
            b = b | (((_bytes(h + V) >> UInt8(g)) & 1) << 4)
        return (fma(a.cast[DType.float32](), sc, mn), fma(b.cast[DType.float32](), sc, mn))
    else:
        # Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d.
        # Weights 128h + 32s + l (half h, quarter s): low 4 bits from ql[64h + 32(s%2) + l]
        # (nibble s//2), high 2 bits from qh[32h + l] >> 2s; value d scale[(.)/16] (q - 32).
        comptime h = g // 4
        comptime s = g % 4
        var ql = _bytes(blk + 64 * h + 32 * (s % 2))
        var ql1 = _bytes(blk + 64 * h + 32 * (s % 2) + V)
        var qh = _bytes(blk + 128 + 32 * h)
        var qh1 = _bytes(blk + 128 + 32 * h + V)
        comptime ls = 4 * (s // 2)
        var a = ((ql >> UInt8(ls)) & 0xF) | (((qh >> UInt8(2 * s)) & 3) << 4)
        var b = ((ql1 >> UInt8(ls)) & 0xF) | (((qh1 >> UInt8(2 * s)) & 3) << 4)
        var d = _half(blk + 208)
        var scales = (blk + 192).unsafe_bitcast[Int8]()
        var s0 = FV(d * scales.unsafe_load(2 * g).cast[DType.float32]())
        var s1 = FV(d * scales.unsafe_load(2 * g + 1).cast[DType.float32]())
        return (
            fma(a.cast[DType.float32](), s0, -32 * s0),
            fma(b.cast[DType.float32](), s1, -32 * s1),
        )


@always_inline
def _tile[fmt: Int, mt: Int](
    x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr,
    K: Int, N: Int, m0: Int, n: Int, has_bias: Bool,
):
    """y[m0 : m0+mt, n]: row `n` of `W` decoded once against `mt` input rows."""
    comptime QK = block_elems[fmt]()
    comptime BS = block_bytes[fmt]()
    comptime G = QK // 32
    var acc = Array[FV, mt * 4](fill=0)
    var row = w + n * (K // QK) * BS
    for blk in range(K // QK):
        var bp = row + blk * BS
        prefetch[PrefetchOptions().for_read().medium_locality()](bp + 4 * BS)
        var x0 = x + m0 * K + blk * QK
        comptime for g in range(G):
            var ws = _decode[fmt, g](bp)
            # Alternate accumulator pairs by group so consecutive FMAs do not chain.
            comptime a = 2 * (g % 2)
            comptime for i in range(mt):
                var xi = x0 + i * K + 32 * g
                acc[i * 4 + a] = fma(ws[0], xi.unsafe_load[width=V](0), acc[i * 4 + a])
                acc[i * 4 + a + 1] = fma(ws[1], xi.unsafe_load[width=V](V), acc[i * 4 + a + 1])
    comptime for i in range(mt):
        var s = ((acc[i * 4] + acc[i * 4 + 1]) + (acc[i * 4 + 2] + acc[i * 4 + 3])).reduce_add()
        if has_bias:
            s += b.unsafe_load(n)
        y.unsafe_store((m0 + i) * N + n, s)


@always_inline
def _row[fmt: Int](
    x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr, M: Int, K: Int, N: Int, n: Int, has_bias: Bool,
):
    """All M input rows against weight row n."""
    var m0 = 0
    while m0 + MT <= M:
        _tile[fmt, MT](x, w, b, y, K, N, m0, n, has_bias)
        m0 += MT
    comptime for rest in range(1, MT):
        if M - m0 == rest:
            _tile[fmt, rest](x, w, b, y, K, N, m0, n, has_bias)


@always_inline
def _decode_rows[fmt: Int](w: U8Ptr, K: Int, n0: Int, rows: Int, dst: F32Ptr):
    """Weight rows n0 : n0+rows, dequantized into `dst` ([rows, K] float32)."""
    comptime QK = block_elems[fmt]()
    comptime BS = block_bytes[fmt]()
    for r in range(rows):
        var row = w + (n0 + r) * (K // QK) * BS
        for blk in range(K // QK):
            comptime for g in range(QK // 32):
                var ws = _decode[fmt, g](row + blk * BS)
                var o = dst + r * K + blk * QK + 32 * g
                o.unsafe_store(0, ws[0])
                o.unsafe_store(V, ws[1])


def packed_matmul[fmt: Int](
    x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr,
    M: Int, K: Int, N: Int, has_bias: Bool, ntasks: Int, ctx: Optional[CpuCtx],
) raises:
    if M > DECODE_ROWS:
        _packed_prefill[fmt](x, w, b, y, M, K, N, has_bias, ntasks, ctx)
        return

    def task(t: Int) {imm x, imm w, imm b, imm y, imm M, imm K, imm N, imm has_bias, imm ntasks}:
        var first = t * N // ntasks
        var last = (t + 1) * N // ntasks
        for n in range(first, last):
            _row[fmt](x, w, b, y, M, K, N, n, has_bias)

    sync_parallelize(task, ntasks, ctx)


def _packed_prefill[fmt: Int](
    x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr,
    M: Int, K: Int, N: Int, has_bias: Bool, ntasks: Int, ctx: Optional[CpuCtx],
) raises:
    """Many rows: each band of `BAND` weight rows is decoded once into a float32
    buffer (in L2) and multiplied by every input row with the skinny kernel's tiles."""

    def task(t: Int) {imm x, imm w, imm b, imm y, imm M, imm K, imm N, imm has_bias, imm ntasks}:
        var nbands = (N + BAND - 1) // BAND
        var first = t * nbands // ntasks
        var last = (t + 1) * nbands // ntasks
        var buf = alloc[Float32](BAND * K, alignment=64)
        for band in range(first, last):
            var n0 = band * BAND
            var rows = min(BAND, N - n0)
            _decode_rows[fmt](w, K, n0, rows, buf)
            for m0 in range(0, M, MC):
                var mc = min(MC, M - m0)
                var j = 0
                while j + SR <= rows:
                    _block[DType.float32, SR](
                        x + m0 * K, buf + j * K, b + n0 + j, y + m0 * N + n0 + j,
                        mc, K, N, 0, has_bias,
                    )
                    j += SR
                while j < rows:
                    _block[DType.float32, 1](
                        x + m0 * K, buf + j * K, b + n0 + j, y + m0 * N + n0 + j,
                        mc, K, N, 0, has_bias,
                    )
                    j += 1
        buf.free()

    sync_parallelize(task, ntasks, ctx)
