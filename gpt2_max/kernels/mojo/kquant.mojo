"""Packed-weight matmul: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ b[N]).

`W` is a GGUF tensor: row `n` is the `K / QK` blocks of output feature `n`, `BYTES`
bytes each, in ggml's block layout, except that the rows are regrouped at load sixteen
to a group, one row a 32-bit vector lane, in the same bytes (`kernels.interleave`; the
rows past the last whole group stay as the file has them).
`x`, `b` and `y` are float32.

At a few rows a step costs the bytes of `W`, so its rows are streamed once, in chunks
of `CHUNK_ROWS` rows shared out as `skinny.mojo`'s are (`share.share_out`: each task
streams a band, then takes over what is left of the others'); each block is decoded
once per tile of input rows (`MT`, a row at a time; `GROUP_MT` sixteen rows at a
time: 8 with one int8 term, 4 with two) and multiplied into per-row accumulators
while its bytes are in L1. Many rows (a prefill) take the same path in chunks of `MC`
rows, so each weight row is decoded once per tile of rows: slower than a kernel that
decodes a band once for all rows, but every row count runs one arithmetic, and a
request's rows come out bit for bit the same whatever they are batched with (a decode
row beside another request's prefill chunk, or alone). With activations rounded to
int8 a prefill-only arithmetic would change a batched request's tokens.

The arithmetic (`dot_path`; the ops' `dot` parameter names one for tests and
benchmarks, DOT_AUTO is what the model runs), where the CPU multiplies bytes
(`INT8_DOT`: AVX-512 VNNI on Zen 4 and Cascade Lake and later Xeons, or AVX2's byte
products on the CPUs without AVX-512, Zen 2 and 3 among them):
- Q4_K and Q6_K: int8, x rounded once per block of 256 (`_X8`), as MAX's vroom kernels
  and llama.cpp's Q8_K round it, sixteen weight rows at a time (`_tile_kx16`).
- Q5_K: int8x2, x rounded so and its remainder rounded again, each multiplied in
  integers, to about 2^-16 of each block's largest activation, sixteen rows at a time
  too: on the Q5_K QKV projections of the Q4_K_M parity test
  (`tests/gguf/test_adapter.py`) one term costs greedy agreement with the float model,
  which the second gives back.
- Q4_0: int8 against x rounded once per block of 32 (`_X8S`), as llama.cpp's Q8_0
  activations, sixteen weight rows at a time (`_tile_b32x16`).
- Q5_0, Q5_1 and Q8_0: int8x2 against x rounded so and its remainder again, sixteen
  rows at a time too; the rows past the last group of sixteen a row at a time
  (`_tile_vnni32`).
Every type has a float32 path, every weight widened in registers (`_tile`, and the
grouped tiles with `terms` 0), for a CPU without AVX2.

Formats (`fmt`, the GGML type id): Q4_0 (2), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12),
Q5_K (13), Q6_K (14).
"""

from std.math import ceildiv, fma
from std.memory import bitcast
from std.sys import CompilationTarget
from std.sys.intrinsics import PrefetchOptions, llvm_intrinsic, prefetch

from max.algorithm import sync_parallelize

from .share import CpuCtx, Epilogue, F32Ptr, Team, share_passes
from .skinny import CHUNK_ROWS

comptime U8Ptr = UnsafePointer[UInt8, MutUntrackedOrigin]
comptime V = 16
"""Lanes per decoded vector; a group of 32 weights is two vectors."""
comptime FV = SIMD[DType.float32, V]
comptime MT = 4
"""Input rows per register tile: each decoded group is used MT times."""
comptime PREFETCH_BYTES = 2048
"""How far ahead of the block being multiplied its row's bytes are requested: a weight
is read once, and a packed row is decoded slowly enough that the hardware prefetcher
alone keeps too few of its lines in flight to hide memory's latency; a few blocks
ahead was too close (`docs/performance.md`, "Packed rows ahead")."""

comptime VNNI_DOT = CompilationTarget._has_feature["avx512vnni"]()
"""Whether the CPU has AVX-512 VNNI (Zen 4, Cascade Lake and later Xeons): the integer
dot products then run in 512-bit registers (`_dot_u8`)."""
comptime INT8_DOT = VNNI_DOT or CompilationTarget._has_feature["avx2"]()
"""Whether the CPU multiplies bytes in integers at all: with VNNI, or with AVX2's
vpmaddubsw and vpmaddwd on halves (Zen 2 and 3, Haswell to Skylake), where the
float32 path widens every weight and streams a third as fast as MAX's kernels."""

comptime Q4_0 = 2
comptime Q5_0 = 6
comptime Q5_1 = 7
comptime Q8_0 = 8
comptime Q4_K = 12
comptime Q5_K = 13
comptime Q6_K = 14


def block_elems[fmt: Int]() -> Int:
    """Weights per block."""
    return 32 if fmt == Q4_0 or fmt == Q5_0 or fmt == Q5_1 or fmt == Q8_0 else 256


def block_bytes[fmt: Int]() -> Int:
    """Bytes per block (ggml's block_q4_0, block_q5_0, block_q5_1, block_q8_0,
    block_q4_K, block_q5_K, block_q6_K)."""
    comptime if fmt == Q4_0:
        return 18
    elif fmt == Q5_0:
        return 22
    elif fmt == Q5_1:
        return 24
    elif fmt == Q8_0:
        return 34
    elif fmt == Q4_K:
        return 144
    elif fmt == Q5_K:
        return 176
    else:
        return 210


def packed_row_bytes[fmt: Int](K: Int) raises -> Int:
    """Bytes of a weight row of `K` values in GGML type `fmt`'s blocks."""
    if K % block_elems[fmt]():
        raise Error(
            "GGML type ", fmt, " packs rows of a multiple of ", block_elems[fmt](),
            " values, not ", K,
        )
    return K // block_elems[fmt]() * block_bytes[fmt]()


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
def _q5[at: Int](blk: U8Ptr) -> SIMD[DType.uint8, 32]:
    """A Q5_0/Q5_1 block's 32 quants (0-31) in weight order: the 4 bytes at `at` hold
    bit 4 of weight l in bit l % 8 of byte l // 8, the 16 after them the low nibbles
    (weights 0-15) and high nibbles (16-31). Each high byte is spread over its 8
    weights' lanes and tested against that lane's bit."""
    var qh = (blk + at).unsafe_load[width=4](0)
    comptime B8 = SIMD[DType.uint8, 8]
    var spread = B8(qh[0]).join(B8(qh[1])).join(B8(qh[2]).join(B8(qh[3])))
    var bit = B8(1, 2, 4, 8, 16, 32, 64, 128)
    var bits = bit.join(bit).join(bit.join(bit))
    var high = (spread & bits).ne(0).select(SIMD[DType.uint8, 32](16), SIMD[DType.uint8, 32](0))
    var q = _bytes(blk + at + 4)
    return (q & 0xF).join(q >> 4) | high


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
    elif fmt == Q5_0 or fmt == Q5_1:
        # d, [Q5_1: m,] 4 bytes of high bits, 16 bytes of low nibbles as Q4_0's;
        # value (q - 16) d (Q5_0) or q d + m (Q5_1).
        var d = FV(_half(blk))
        var q = _q5[2 if fmt == Q5_0 else 4](blk).cast[DType.float32]()
        var lo = q.slice[V, offset=0]()
        var hi = q.slice[V, offset=V]()
        comptime if fmt == Q5_0:
            return (fma(lo, d, -16 * d), fma(hi, d, -16 * d))
        else:
            var m = FV(_half(blk + 2))
            return (fma(lo, d, m), fma(hi, d, m))
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
        prefetch[PrefetchOptions().for_read().medium_locality()](bp + PREFETCH_BYTES)
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
    x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr,
    K: Int, N: Int, m_begin: Int, m_end: Int, n: Int, has_bias: Bool,
):
    """Input rows m_begin : m_end against weight row n, in tiles of up to MT rows."""
    var m0 = m_begin
    while m0 + MT <= m_end:
        _tile[fmt, MT](x, w, b, y, K, N, m0, n, has_bias)
        m0 += MT
    comptime for rest in range(1, MT):
        if m_end - m0 == rest:
            _tile[fmt, rest](x, w, b, y, K, N, m0, n, has_bias)


comptime IV = SIMD[DType.int32, 16]
comptime QV = SIMD[DType.uint8, 64]
comptime XV = SIMD[DType.int8, 64]
comptime I8Ptr = UnsafePointer[Int8, MutUntrackedOrigin]


@always_inline
def _sub_elems[fmt: Int]() -> Int:
    """Weights per sub-block: 16 (Q6_K) or 32 (Q4_K, Q5_K)."""
    return 16 if fmt == Q6_K else 32


comptime X8_SHARED_BLOCKS = 64
"""Blocks of x (of 256 values) from which `_X8` rounds them on every task."""


struct _X8[fmt: Int, terms: Int]:
    """x[M, K] rounded to int8 per block of 256 (`q`, [M, K]), the blocks' scales (`d`,
    [M, K / 256]) and each sub-block's sum of the rounded x (`sums`, [M, K / sub]). With
    `terms` 2, `lo` ([M, K]) rounds what is left, x - d q, on the step d / 254, so that
    x ~ d (q + lo / 254) to about 2^-16 of the block's largest. For Q6_K, `offsets`
    ([M, K / 16, terms]) is -32 times each sub-block's sum of each term's integers,
    where the grouped tiles start its integer sums: Q6_K's values are q - 32, and the
    offset's share then costs nothing per row."""

    var q: I8Ptr
    var lo: I8Ptr
    var d: F32Ptr
    var sums: F32Ptr
    var offsets: I32Ptr

    def __init__(
        out self, x: F32Ptr, M: Int, K: Int, team: Team = Team.launch(1, None)
    ) raises:
        comptime SUB = _sub_elems[Self.fmt]()
        var nb = M * K // 256
        self.q = alloc[Int8](max(M * K, 1), alignment=64)
        self.lo = alloc[Int8](max(M * K, 1) if Self.terms == 2 else 1, alignment=64)
        self.d = alloc[Float32](max(nb, 1), alignment=64)
        self.sums = alloc[Float32](max(M * K // SUB, 1), alignment=64)
        self.offsets = alloc[Int32](
            max(M * K // SUB * Self.terms, 1) if Self.fmt == Q6_K else 1, alignment=64
        )
        var q = self.q
        var lo = self.lo
        var ds = self.d
        var sums = self.sums
        var offsets = self.offsets

        # A prefill's rows are rounded by every task (a step's few rows are not worth
        # waking them for): one thread rounding them left the others waiting.
        var tasks = team.starts() if nb >= X8_SHARED_BLOCKS else 1

        def rows(t: Int) {imm x, imm nb, imm tasks, imm q, imm lo, imm ds, imm sums, imm offsets}:
            for r in range(t * nb // tasks, (t + 1) * nb // tasks):
                Self._round(x, r, q, lo, ds, sums, offsets)

        if tasks > 1:
            sync_parallelize(rows, tasks, team.ctx)
        else:
            rows(0)

    @staticmethod
    @always_inline
    def _round(
        x: F32Ptr, r: Int, q8: I8Ptr, lo8: I8Ptr, ds: F32Ptr, sums: F32Ptr, offsets: I32Ptr
    ):
        """Block r: its scale, its int8s (and remainders), its sub-blocks' sums."""
        comptime SUB = _sub_elems[Self.fmt]()
        var src = x + 256 * r
        var amax = FV(0)
        comptime for j in range(16):
            amax = max(amax, abs(src.unsafe_load[width=16](16 * j)))
        var top = amax.reduce_max()
        var d = top / 127
        var inv = Float32(127) / top if top > 0 else Float32(0)
        ds.unsafe_store(r, d)
        var pair = Float32(0)
        comptime for j in range(16):
            var v = src.unsafe_load[width=16](16 * j)
            var q = round(v * inv)
            var o = 256 * r + 16 * j
            (q8 + o).unsafe_store(0, q.cast[DType.int8]())
            var s = q.reduce_add() * d
            comptime if Self.fmt == Q6_K:
                var at = (16 * r + j) * Self.terms
                offsets.unsafe_store(at, Self._offset(q))
            comptime if Self.terms == 2:
                var lo = round((v - q * d) * (inv * 254))
                (lo8 + o).unsafe_store(0, lo.cast[DType.int8]())
                s += lo.reduce_add() * (d / 254)
                comptime if Self.fmt == Q6_K:
                    var at = (16 * r + j) * 2 + 1
                    offsets.unsafe_store(at, Self._offset(lo))
            comptime if SUB == 16:
                sums.unsafe_store(16 * r + j, s)
            elif j % 2 == 0:
                pair = s
            else:
                sums.unsafe_store(8 * r + j // 2, pair + s)

    @staticmethod
    @always_inline
    def _offset(q: FV) -> Int32:
        """-32 times a Q6_K sub-block's 16 integers `q`, where its integer sums start: one
        int32 for vpdpbusd; without VNNI (`_I16_RUN`) two i16, -32 times the sum of the
        integers at 4k and 4k+1, then at 4k+2 and 4k+3 (at most 32 * 8 * 127 each), as
        AVX2's byte products pair them."""
        comptime if VNNI_DOT:
            return (q.reduce_add() * -32).cast[DType.int32]()
        var pairs = q.reduce_add[4]()  # x[4k + i] summed over k, i = 0..3
        var low = ((pairs[0] + pairs[1]) * -32).cast[DType.int32]()
        var high = ((pairs[2] + pairs[3]) * -32).cast[DType.int32]()
        return (low & 0xFFFF) | (high << 16)

    def free(self):
        self.q.free()
        self.lo.free()
        self.d.free()
        self.sums.free()
        self.offsets.free()


@always_inline
def _maddubs_avx2(u: QV, x: XV) -> SIMD[DType.int16, 32]:
    """Lane l: u[2l] x[2l] + u[2l+1] x[2l+1] in i16 (vpmaddubsw on each half; it
    saturates, so the callers keep each pair within i16)."""
    comptime H = SIMD[DType.int16, 16]
    var lo = llvm_intrinsic["llvm.x86.avx2.pmadd.ub.sw", H](
        u.slice[32, offset=0](), x.slice[32, offset=0]()
    )
    var hi = llvm_intrinsic["llvm.x86.avx2.pmadd.ub.sw", H](
        u.slice[32, offset=32](), x.slice[32, offset=32]()
    )
    return lo.join(hi)


@always_inline
def _widen_avx2(
    s: SIMD[DType.int16, 32], by: SIMD[DType.int16, 32] = SIMD[DType.int16, 32](1)
) -> IV:
    """Lane l: (s[2l] + s[2l+1]) by[2l] in i32 (vpmaddwd on each half), `by` a lane's
    factor twice (`_pairs`): ones by default, or a weight row's sub-block scale."""
    comptime I = SIMD[DType.int32, 8]
    var a = llvm_intrinsic["llvm.x86.avx2.pmadd.wd", I](
        s.slice[16, offset=0](), by.slice[16, offset=0]()
    )
    var b = llvm_intrinsic["llvm.x86.avx2.pmadd.wd", I](
        s.slice[16, offset=16](), by.slice[16, offset=16]()
    )
    return a.join(b)


@always_inline
def _pairs(v: SIMD[DType.int16, 16]) -> SIMD[DType.int16, 32]:
    """Each lane of `v` twice: the factor of a 32-bit lane's two i16 for `_widen_avx2`."""
    return v.interleave(v)


@always_inline
def _madd_avx2(u: QV, x: XV) -> IV:
    """Lane l: the sum over bytes 4l .. 4l+3 of u x, the pairs of products summed into
    i16 by vpmaddubsw (which saturates: the callers keep u x + u x within i16), then
    into i32 by vpmaddwd against ones."""
    return _widen_avx2(_maddubs_avx2(u, x))


comptime _I16_RUN[fmt: Int] = 8 if fmt == Q4_K else 4
"""Columns of a K-quant sub-block whose AVX2 byte products one i16 lane sums before they
are widened: 8 of Q4_K's (quants below 16, times |x| <= 127, two a pair: 8 pairs stay
under 2^15), 4 of Q5_K's (below 32); Q6_K's 4 of a sub-block start at its offset (-32
times x's pairs: `_X8`), so the lane ends at (q - 32) x, under 2^15, and its sums on
the way, which may pass it, wrap back (vpaddw does not saturate)."""


# ---- 32-value blocks (Q4_0, Q5_0, Q5_1, Q8_0) through 8-bit integer dot products ----
#
# x is rounded to int8 per block of 32 (`_X8S`: x ~ dx q8, dx = max |x| / 127), as ggml's
# Q8_0 rounds the activations these types multiply, with `terms` 2 the remainder again
# on the step dx / 254. A weight row's blocks are taken two at a time (64 weights, one
# vector) as unsigned bytes u, which vpdpbusd multiplies by x's signed ones four at a
# time: Q5_1's q as it is, Q4_0's and Q5_0's q and Q8_0's q + 128, whose offsets (8, 16,
# 128 steps of d) the x side pays once per block, its sum of q8 times -offset preloaded
# in the accumulator (`_X8S.init`). Q5_1's min adds m * sum(rounded x) per block. The integer
# sums of the two blocks land in lanes 0-7 and 8-15 of one accumulator, each scaled by
# its block's d dx in one float FMA.


comptime I32Ptr = UnsafePointer[Int32, MutUntrackedOrigin]


@always_inline
def _offset32[fmt: Int]() -> Int:
    """What a 32-value block type's unsigned byte u holds beyond its value in steps of
    d: Q4_0's value is (u - 8) d, Q5_0's (u - 16) d, Q8_0's (u - 128) d, Q5_1's u d + m.
    Without VNNI Q8_0's bytes stay signed (`_dot_u8`), offset 0."""
    comptime if fmt == Q8_0 and not VNNI_DOT:
        return 0
    comptime if fmt == Q4_0:
        return 8
    return 16 if fmt == Q5_0 else (128 if fmt == Q8_0 else 0)


struct _X8S[fmt: Int, terms: Int]:
    """x[M, K] rounded to int8 per block of 32 (`q`, [M, K] plus a vector of slack for
    a row's odd last block, read as a pair), with `terms` 2 also `lo`, x - dx q rounded
    on the step dx / 254. Per pair of blocks of a row (`pairs` a row): `d`, each
    block's dx in its 8 lanes, and `init`, the accumulators' start: -offset times the
    block's sum of q (and then of lo) in its first lane, what u's offset adds to the
    integer sum. For Q5_1 `sums`, [M, K / 32], holds the blocks' sums of the rounded
    x, for its min (the same x its quants multiply, so the rounding meets d q + m
    whole); the other types need none."""

    var q: I8Ptr
    var lo: I8Ptr
    var d: F32Ptr
    var init: I32Ptr
    var sums: F32Ptr
    var pairs: Int

    def __init__(out self, x: F32Ptr, M: Int, K: Int):
        comptime off = Float32(_offset32[Self.fmt]())
        var nb = K // 32
        self.pairs = (nb + 1) // 2
        var lanes = M * self.pairs * 16
        self.q = alloc[Int8](M * K + 64, alignment=64)
        self.lo = alloc[Int8](M * K + 64 if Self.terms == 2 else 1, alignment=64)
        self.d = alloc[Float32](lanes, alignment=64)
        self.init = alloc[Int32](lanes * Self.terms, alignment=64)
        self.sums = alloc[Float32](M * nb if Self.fmt == Q5_1 else 1, alignment=64)
        for i in range(lanes):
            self.d.unsafe_store(i, 0)
        for i in range(lanes * Self.terms):
            self.init.unsafe_store(i, 0)
        for r in range(M * nb):
            var src = x + 32 * r
            var v0 = src.unsafe_load[width=16](0)
            var v1 = src.unsafe_load[width=16](16)
            var top = max(abs(v0), abs(v1)).reduce_max()
            var d = top / 127
            var inv = Float32(127) / top if top > 0 else Float32(0)
            var q0 = round(v0 * inv)
            var q1 = round(v1 * inv)
            (self.q + 32 * r).unsafe_store(0, q0.cast[DType.int8]())
            (self.q + 32 * r + 16).unsafe_store(0, q1.cast[DType.int8]())
            var qsum = (q0 + q1).reduce_add()
            var sum = qsum * d
            var pair = (r // nb) * self.pairs + (r % nb) // 2
            var half = 8 * (r % nb % 2)
            self.d.unsafe_store(pair * 16 + half, SIMD[DType.float32, 8](d))
            var first = pair * 16 * Self.terms + half
            self.init.unsafe_store(first, (-off * qsum).cast[DType.int32]())
            comptime if Self.terms == 2:
                var l0 = round((v0 - q0 * d) * (inv * 254))
                var l1 = round((v1 - q1 * d) * (inv * 254))
                (self.lo + 32 * r).unsafe_store(0, l0.cast[DType.int8]())
                (self.lo + 32 * r + 16).unsafe_store(0, l1.cast[DType.int8]())
                var lsum = (l0 + l1).reduce_add()
                sum += lsum * (d / 254)
                self.init.unsafe_store(first + 16, (-off * lsum).cast[DType.int32]())
            comptime if Self.fmt == Q5_1:
                self.sums.unsafe_store(r, sum)
        comptime for i in range(4):
            (self.q + M * K + 16 * i).unsafe_store(0, SIMD[DType.int8, 16](0))
            comptime if Self.terms == 2:
                (self.lo + M * K + 16 * i).unsafe_store(0, SIMD[DType.int8, 16](0))

    def free(self):
        self.q.free()
        self.lo.free()
        self.d.free()
        self.init.free()
        self.sums.free()


@always_inline
def _unsigned32[fmt: Int](blk: U8Ptr) -> SIMD[DType.uint8, 32]:
    """A 32-value block's quants in weight order as unsigned bytes (`_offset32`)."""
    comptime if fmt == Q8_0:
        comptime if not VNNI_DOT:
            return blk.unsafe_load[width=32](2)
        return blk.unsafe_load[width=32](2) ^ 0x80
    elif fmt == Q4_0:
        var q = _bytes(blk + 2)
        return (q & 0xF).join(q >> 4)
    else:
        return _q5[2 if fmt == Q5_0 else 4](blk)


@always_inline
def _sign_avx2(x: XV, w: XV) -> XV:
    """x negated where w is negative and zeroed where it is 0 (vpsignb on each half): x
    multiplied by w's sign, for |w| x in `_dot_u8`."""
    comptime B = SIMD[DType.int8, 32]
    var lo = llvm_intrinsic["llvm.x86.avx2.psign.b", B](
        x.slice[32, offset=0](), w.slice[32, offset=0]()
    )
    var hi = llvm_intrinsic["llvm.x86.avx2.psign.b", B](
        x.slice[32, offset=32](), w.slice[32, offset=32]()
    )
    return lo.join(hi)


@always_inline
def _dot_u8[fmt: Int](acc: IV, u: QV, x: XV) -> IV:
    """acc[l] += u[4l] x[4l] + ... + u[4l+3] x[4l+3] (vpdpbusd: unsigned by signed bytes,
    no saturation). Without VNNI, vpmaddubsw's i16 pairs would saturate on Q8_0's
    u up to 255, so its bytes come signed (`_unsigned32`) and multiply as ggml's AVX2
    kernels do: |w| by x with w's sign."""
    comptime if not VNNI_DOT:
        comptime if fmt == Q8_0:
            var w = bitcast[DType.int8, 64](u)
            return acc + _madd_avx2(bitcast[DType.uint8, 64](abs(w)), _sign_avx2(x, w))
        return acc + _madd_avx2(u, x)
    return llvm_intrinsic["llvm.x86.avx512.vpdpbusd.512", IV](acc, u, x)


@always_inline
def _lanes(a: Float32, b: Float32) -> FV:
    """a in lanes 0-7, b in lanes 8-15."""
    return SIMD[DType.float32, 8](a).join(SIMD[DType.float32, 8](b))


@always_inline
def _tile_vnni32[fmt: Int, terms: Int, mt: Int](
    xq: _X8S[fmt, terms], w: U8Ptr, b: F32Ptr, y: F32Ptr,
    K: Int, N: Int, m0: Int, n: Int, has_bias: Bool,
):
    """y[m0 : m0+mt, n] for a row `n` of 32-value blocks, through 8-bit integer dot
    products, two blocks at a time."""
    comptime BS = block_bytes[fmt]()
    var nb = K // 32
    var acc = Array[FV, mt * terms](fill=0)
    var mins = Array[Float32, mt](fill=0)
    var row = w + n * nb * BS
    for p in range(xq.pairs):
        var pa = row + 2 * p * BS
        prefetch[PrefetchOptions().for_read().medium_locality()](pa + PREFETCH_BYTES)
        var two = 2 * p + 1 < nb
        var u = _unsigned32[fmt](pa).join(
            _unsigned32[fmt](pa + BS) if two else SIMD[DType.uint8, 32](0)
        )
        var wd = _lanes(_half(pa), _half(pa + BS) if two else Float32(0))
        var ma = Float32(0)
        var mb = Float32(0)
        comptime if fmt == Q5_1:
            ma = _half(pa + 2)
            mb = _half(pa + BS + 2) if two else Float32(0)
        comptime for i in range(mt):
            var xp = ((m0 + i) * xq.pairs + p) * 16
            var o = (m0 + i) * K + 64 * p
            var scale = wd * xq.d.unsafe_load[width=16](xp)
            var isum = _dot_u8[fmt](xq.init.unsafe_load[width=16](xp * terms), u,
                               (xq.q + o).unsafe_load[width=64](0))
            acc[terms * i] = fma(isum.cast[DType.float32](), scale, acc[terms * i])
            comptime if terms == 2:
                var lsum = _dot_u8[fmt](xq.init.unsafe_load[width=16](xp * 2 + 16), u,
                                   (xq.lo + o).unsafe_load[width=64](0))
                acc[2 * i + 1] = fma(lsum.cast[DType.float32](), scale, acc[2 * i + 1])
            comptime if fmt == Q5_1:
                var r = (m0 + i) * nb + 2 * p
                mins[i] += ma * xq.sums.unsafe_load(r) + (
                    mb * xq.sums.unsafe_load(r + 1) if two else Float32(0)
                )
    comptime for i in range(mt):
        var s = acc[terms * i].reduce_add() + mins[i]
        comptime if terms == 2:
            s += acc[2 * i + 1].reduce_add() * (1.0 / 254)
        if has_bias:
            s += b.unsafe_load(n)
        y.unsafe_store((m0 + i) * N + n, s)


@always_inline
def _row_vnni32[fmt: Int, terms: Int](
    xq: _X8S[fmt, terms], w: U8Ptr, b: F32Ptr, y: F32Ptr,
    K: Int, N: Int, m_begin: Int, m_end: Int, n: Int, has_bias: Bool,
):
    var m0 = m_begin
    while m0 + MT <= m_end:
        _tile_vnni32[fmt, terms, MT](xq, w, b, y, K, N, m0, n, has_bias)
        m0 += MT
    comptime for rest in range(1, MT):
        if m_end - m0 == rest:
            _tile_vnni32[fmt, terms, rest](xq, w, b, y, K, N, m0, n, has_bias)


# ---- The 32-value blocks sixteen rows at a time (`kernels.interleave` lays them out) -
#
# One row at a time (`_tile_vnni32`), a decode step spends more instructions on each
# block's bookkeeping (its scale widened, two blocks joined into a vector, the lanes
# summed at the end) than on its dot products, and streams these types at half the
# float32 rate. Here each group of 16 weight rows is read together, one row a lane:
# block b of group g is the 16 rows' d (32 bytes of float16, widened by one
# instruction), [Q5_1: their m,] [Q5_0 and Q5_1: their high bits, 4 bytes a row,
# regrouped so that byte i's bit c is weight 4c + i's (`kernels._q5_lanes`),] then
# their quants, 4 bytes a row in each 64-byte vector: Q4_0's, Q5_0's and Q5_1's 16
# bytes as four vectors whose low nibbles are weights 4j .. 4j+3 and high nibbles 16+4j
# .. 16+4j+3, Q8_0's 32 as eight vectors of weights 4j .. 4j+3. So each block of the 16
# rows is eight columns of 4 weights (`_b32x16_col`), each multiplied by x's 4 bytes of
# those weights, broadcast: 8 integer dot products and one float FMA per term, the
# type's offset preloaded in the integer sum (`_X8S.init`, the same for every row),
# Q5_1's m times the block's sum of x in one more FMA. The rows past the last whole
# group keep the file's layout and take `_tile_vnni32`, so a weight of any row count
# multiplies; every row count of x takes the same path, so a request's rows come out
# the same whatever they are batched with.

comptime GROUP = 16
"""Weight rows read together by the grouped tiles, one a lane."""
comptime GROUP_MT[terms: Int] = 8 // terms
"""Input rows per grouped tile with `terms` int8 terms of x (1 on the float32 path):
each column is rebuilt once per tile, so a prefill wants a tall one; 8 sums of one
term, or 4 of two, still fit the registers."""


@always_inline
def _halves(p: U8Ptr) -> FV:
    """The 16 float16s at `p`, widened."""
    return p.unsafe_bitcast[Float16]().unsafe_load[width=GROUP](0).cast[DType.float32]()


@always_inline
def _b32_high_bits[fmt: Int]() -> Int:
    """Where a grouped Q5_0 or Q5_1 block's high bits start: after the rows' d [and m]."""
    return (2 if fmt == Q5_0 else 4) * GROUP


@always_inline
def _b32_quants[fmt: Int]() -> Int:
    """Where a grouped 32-value block's quants start (`kernels.FIELDS`)."""
    comptime if fmt == Q5_0 or fmt == Q5_1:
        return _b32_high_bits[fmt]() + 4 * GROUP
    return 2 * GROUP


@always_inline
def _b32x16_col[fmt: Int, c: Int](bp: U8Ptr) -> QV:
    """Column c of the grouped block at `bp`: weights 4c .. 4c+3 of the 16 rows, one a
    32-bit lane, as the unsigned bytes `_dot_u8` multiplies (`_offset32`): Q8_0's
    vector c, or vector c % 4's low (c < 4) or high nibbles, with Q5_x's bit 4 from bit c
    of each byte of the high bits (shifted in 16-bit lanes: no bit the mask keeps
    crosses a byte)."""
    var q = bp + _b32_quants[fmt]()
    comptime if fmt == Q8_0:
        var v = (q + 64 * c).unsafe_load[width=64](0)
        comptime if VNNI_DOT:
            return v ^ 0x80
        return v
    var v = (q + 64 * (c % 4)).unsafe_load[width=64](0)
    var u = (v & 0xF) if c < 4 else (v >> 4)
    comptime if fmt == Q5_0 or fmt == Q5_1:
        var h = bitcast[DType.uint16, 32]((bp + _b32_high_bits[fmt]()).unsafe_load[width=64](0))
        comptime if c <= 4:
            u = u | bitcast[DType.uint8, 64]((h << UInt16(4 - c)) & 0x1010)
        else:
            u = u | bitcast[DType.uint8, 64]((h >> UInt16(c - 4)) & 0x1010)
    return u


@always_inline
def _tile_b32x16[fmt: Int, terms: Int, mt: Int](
    xq: _X8S[fmt, terms], w: U8Ptr, b: F32Ptr, y: F32Ptr,
    K: Int, N: Int, m0: Int, g: Int, has_bias: Bool,
):
    """y[m0 : m0+mt, 16g : 16g+16] from group `g` of `kernels.interleave`'s layout."""
    comptime GB = GROUP * block_bytes[fmt]()
    var nb = K // 32
    var acc = Array[FV, mt * terms](fill=0)
    var grp = w + g * nb * GB
    for blk in range(nb):
        var bp = grp + blk * GB
        comptime for line in range(0, GB, 64):
            prefetch[PrefetchOptions().for_read().medium_locality()](bp + PREFETCH_BYTES + line)
        var d = _halves(bp)
        var cols = Array[QV, 8](fill=0)
        comptime for c in range(8):
            cols[c] = _b32x16_col[fmt, c](bp)
        comptime for i in range(mt):
            var pair = (m0 + i) * xq.pairs + blk // 2
            var half = 8 * (blk % 2)
            var scale = d * xq.d.unsafe_load(pair * 16 + half)
            var o = (m0 + i) * K + 32 * blk
            comptime for t in range(terms):
                var xs = ((xq.q if t == 0 else xq.lo) + o).unsafe_bitcast[Int32]()
                # Four sums of two products each, added at the end: a chain of eight
                # dependent products would leave the block waiting on their latency.
                var part = Array[IV, 4](fill=0)
                part[0] = IV(xq.init.unsafe_load(pair * 16 * terms + half + 16 * t))
                comptime for c in range(8):
                    var xc = bitcast[DType.int8, 64](IV(xs.unsafe_load(c)))
                    part[c % 4] = _dot_u8[fmt](part[c % 4], cols[c], xc)
                var isum = (part[0] + part[1]) + (part[2] + part[3])
                acc[terms * i + t] = fma(isum.cast[DType.float32](), scale, acc[terms * i + t])
            comptime if fmt == Q5_1:
                var xsum = xq.sums.unsafe_load((m0 + i) * nb + blk)
                acc[terms * i] = fma(_halves(bp + 2 * GROUP), FV(xsum), acc[terms * i])
    comptime for i in range(mt):
        var s = acc[terms * i]
        comptime if terms == 2:
            s += acc[2 * i + 1] * (1.0 / 254)
        if has_bias:
            s += b.unsafe_load[width=GROUP](GROUP * g)
        y.unsafe_store((m0 + i) * N + GROUP * g, s)


@always_inline
def _tile_b32x16_f32[fmt: Int, mt: Int](
    x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr,
    K: Int, N: Int, m0: Int, g: Int, has_bias: Bool,
):
    """`_tile_b32x16` in float32 (a CPU without AVX2, or `dot` float32 named): each
    weight of a row's lane widened to its value and multiplied by its x, broadcast."""
    comptime GB = GROUP * block_bytes[fmt]()
    comptime off = Float32(_offset32[fmt]())
    var nb = K // 32
    var acc = Array[FV, mt](fill=0)
    var grp = w + g * nb * GB
    for blk in range(nb):
        var bp = grp + blk * GB
        var d = _halves(bp)
        var m = _halves(bp + 2 * GROUP) if fmt == Q5_1 else FV(0)
        comptime for c in range(8):
            var q = bitcast[DType.uint32, GROUP](_b32x16_col[fmt, c](bp))
            comptime for k in range(4):
                var u: FV
                comptime if fmt == Q8_0 and not VNNI_DOT:  # signed bytes (`_offset32`)
                    u = (bitcast[DType.int32, GROUP](q << UInt32(24 - 8 * k)) >> 24).cast[DType.float32]()
                else:
                    u = ((q >> UInt32(8 * k)) & 0xFF).cast[DType.float32]()
                var v = fma(u - off, d, m)
                comptime for i in range(mt):
                    var xv = x.unsafe_load((m0 + i) * K + 32 * blk + 4 * c + k)
                    acc[i] = fma(v, FV(xv), acc[i])
    comptime for i in range(mt):
        var s = acc[i]
        if has_bias:
            s += b.unsafe_load[width=GROUP](GROUP * g)
        y.unsafe_store((m0 + i) * N + GROUP * g, s)


@always_inline
def _group_b32x16[fmt: Int, terms: Int, mt: Int](
    xq: _X8S[fmt, max(terms, 1)], x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr,
    K: Int, N: Int, m0: Int, g: Int, has_bias: Bool,
):
    comptime if terms == 0:
        _tile_b32x16_f32[fmt, mt](x, w, b, y, K, N, m0, g, has_bias)
    else:
        _tile_b32x16[fmt, max(terms, 1), mt](xq, w, b, y, K, N, m0, g, has_bias)


def _share_groups[Group: def(Int, Int, Int) -> None, Tail: def(Int, Int, Int) -> None](
    group: Group, tail: Tail, y: F32Ptr, M: Int, N: Int, team: Team, epi: Epilogue
) raises:
    """`group(m_begin, m_end, g)` for every group of `GROUP` weight rows and `tail(m_begin,
    m_end, n)` for each row past the last whole group, every pass of up to `MC` input
    rows, shared out (`share.share_passes`) in chunks of `CHUNK_ROWS` rows, each chunk's
    outputs in `y` then finished by `epi`."""
    var groups = N // GROUP
    comptime PER_CHUNK = CHUNK_ROWS // GROUP
    comptime assert CHUNK_ROWS % GROUP == 0, "a chunk's columns are whole groups"
    var nchunks = max(1, ceildiv(groups, PER_CHUNK))

    def chunk(m_begin: Int, m_end: Int, c: Int) {
        imm group, imm tail, imm y, imm N, imm groups, imm nchunks, imm epi,
    }:
        for g in range(c * PER_CHUNK, min((c + 1) * PER_CHUNK, groups)):
            group(m_begin, m_end, g)
        var last = c == nchunks - 1
        if last:
            for n in range(groups * GROUP, N):
                tail(m_begin, m_end, n)
        epi.apply(y, N, m_begin, m_end, c * CHUNK_ROWS, N if last else (c + 1) * CHUNK_ROWS)

    share_passes(chunk, M, nchunks, team)


def _packed_b32x16[fmt: Int, terms: Int](
    x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr,
    M: Int, K: Int, N: Int, has_bias: Bool, team: Team, epi: Epilogue,
) raises:
    """A 32-value block type in `kernels.interleave`'s layout, with `terms` int8 terms of
    x, or (0) in float32."""
    comptime T = max(terms, 1)
    comptime QMT = GROUP_MT[T]
    # x rounded for the integer paths; the float32 one reads x as it is.
    var xq = _X8S[fmt, T](x, M if terms else 0, K)

    def group(m_begin: Int, m_end: Int, g: Int) {imm xq, imm x, imm w, imm b, imm y, imm K, imm N, imm has_bias}:
        var m0 = m_begin
        while m0 + QMT <= m_end:
            _group_b32x16[fmt, terms, QMT](xq, x, w, b, y, K, N, m0, g, has_bias)
            m0 += QMT
        comptime for rest in range(1, QMT):
            if m_end - m0 == rest:
                _group_b32x16[fmt, terms, rest](xq, x, w, b, y, K, N, m0, g, has_bias)

    def tail(m_begin: Int, m_end: Int, n: Int) {imm xq, imm x, imm w, imm b, imm y, imm K, imm N, imm has_bias}:
        comptime if terms == 0:
            _row[fmt](x, w, b, y, K, N, m_begin, m_end, n, has_bias)
        else:
            _row_vnni32[fmt, T](xq, w, b, y, K, N, m_begin, m_end, n, has_bias)

    _share_groups(group, tail, y, M, N, team, epi)
    xq.free()


# ---- The K-quants sixteen rows at a time (`kernels.interleave` lays the blocks out) ---
#
# The same grouping for the K-quants: block b of a group holds the 16 rows' float16 d
# (and Q4_K's and Q5_K's dmin), their scales one row a byte lane (Q4_K's and Q5_K's 12
# packed bytes, Q6_K's 16 int8s), [Q5_K: its 32 bytes of high bits, 4 a row and 32-bit
# lane,] then their quants 4 bytes a row and lane, so that each 64-byte vector holds 4
# neighbouring weights of every row (a column, `_kx16_col`): Q4_K's nibbles as the file
# pairs its sub-blocks, Q5_K's the same with bit 4 from the high bits' vector of those
# 4 weights, Q6_K's 6-bit quants from three vectors per four columns, one AND a column
# for three of them (`kernels._q6_k_lanes`). Per sub-block j and input row,
# its columns go into one integer sum I_j (vpdpbusd against x's 4 int8s there,
# broadcast), scaled by the rows' integer scales in one float FMA; per block,
#     y += d dx sum_j sc_j I_j + sum_j c_j s_j
# with s_j the sub-block's sum of rounded x (`_X8.sums`) and c_j = -dmin m_j (Q4_K, Q5_K) or
# -32 d sc_j (Q6_K, whose values are d sc (q - 32); on the integer paths its I_j start
# at -32 times the sub-block's integers instead, `_X8.offsets`, which saves an FMA per
# row and sub-block). With `terms` 0 the same sums are
# taken in float32 over x as it is. No bookkeeping is per row: a row's dot product is
# a lane, so a decode step spends its instructions on the dot products, where a row at
# a time spent as many again on each row's sums and scales. Without VNNI, AVX2's byte
# products come in i16 pairs that a second multiply (vpmaddwd) widens to i32; they are
# summed in the i16 lanes over a run of columns first (`_I16_RUN`), and that multiply
# takes the rows' scale of the sub-block (`_pairs`) rather than ones, so a block's sums
# stay integers to its end and one conversion there replaces a float FMA per sub-block
# and row.

comptime GROUP_PREFETCH = 4 * PREFETCH_BYTES
"""How far ahead of a K-quant group's block its bytes are requested: a group streams
16 rows' bytes per block, and `PREFETCH_BYTES` ahead left the one-row step waiting on
memory (`docs/performance.md`, "Packed rows ahead")."""

comptime AccV[terms: Int] = SIMD[DType.float32 if terms == 0 else DType.int32, 16]
"""A column's sums for 16 weight rows: int32 on the integer paths, float32 on `terms` 0."""


@always_inline
def _mac4[terms: Int](acc: AccV[terms], u: QV, xi: I8Ptr, xf: F32Ptr, o: Int) -> AccV[terms]:
    """acc[r] += the sum over i < 4 of byte 4r + i of `u` (a column: weight o + i of
    row r) times x[o + i]: one vpdpbusd against x's 4 int8s at `xi` + o, broadcast (or
    AVX2's byte products: quants below 64 keep their pairs within i16), or (terms 0)
    four float32 FMAs against `xf`."""
    comptime if terms == 0:
        var wd = bitcast[DType.uint32, GROUP](u)
        var a = rebind[FV](acc)
        comptime for i in range(4):
            var q = ((wd >> UInt32(8 * i)) & 0xFF).cast[DType.float32]()
            a = fma(q, FV(xf.unsafe_load(o + i)), a)
        return rebind[AccV[terms]](a)
    else:
        var xb = bitcast[DType.int8, 64](IV((xi + o).unsafe_bitcast[Int32]().unsafe_load(0)))
        return rebind[AccV[terms]](_dot_u8[Q4_K](rebind[IV](acc), u, xb))


comptime KX16_STEP[fmt: Int] = 2 if fmt != Q6_K else (16 if VNNI_DOT else 1)
"""Sub-blocks a grouped tile takes per trip of its loop over a block: Q4_K's (and
Q5_K's) two of a pair (the loop's body then fits the decoded-instruction cache, where
its eight sub-blocks unrolled ran 10-20% slower at eight input rows); Q6_K's sixteen
unrolled with VNNI, one a trip on AVX2, whose 16 registers the unrolled block
overflowed: LLVM hoisted its loads and broadcasts out of the sub-blocks and spilled
them."""
comptime Q6_LAST = 12
"""Q6_K's sub-blocks from this one on hold the block's last quarter of columns, each
spread over the top bits of three bytes (`kernels._q6_k_lanes`)."""


@always_inline
def _kx16_col[fmt: Int, jj: Int, k: Int, last: Bool](q: U8Ptr, j0: Int) -> QV:
    """Column k of sub-block j = j0 + jj (j0 a multiple of `KX16_STEP`; weights
    `_sub_elems` j + 4k .. +3 of the 16 rows, one a 32-bit lane) from the quants at `q`.
    Q4_K: vector k of pair j / 2, its low (even j) or high nibbles. Q5_K: Q4_K's nibble,
    and bit j of the rows' high bytes 4k .. 4k+3 (the 512 bytes before the quants, a
    unit of 4 a row) as its bit 4. Q6_K: column c = 4j + k is c % 16 = u's unit c / 16,
    its low six bits, or (`last`: j from `Q6_LAST` on) the top two bits of u's three
    units (shifted in 16-bit lanes: no bit the masks keep crosses a byte)."""
    comptime if fmt == Q4_K or fmt == Q5_K:
        var v = (q + 512 * (j0 // 2 + jj // 2) + 64 * k).unsafe_load[width=64](0)
        comptime if jj % 2 == 0:
            v = v & 0xF
        else:
            v = v >> 4
        comptime if fmt == Q5_K:
            var h = bitcast[DType.uint16, 32]((q - 512 + 64 * k).unsafe_load[width=64](0))
            v = v | bitcast[DType.uint8, 64](((h >> UInt16(j0 + jj)) & 0x0101) << 4)
        return v
    else:
        var j = j0 + jj
        var p = q + 192 * (4 * (j % 4) + k)
        comptime if not last:
            return p.unsafe_load[width=64](64 * (j // 4)) & 0x3F
        var va = bitcast[DType.uint16, 32](p.unsafe_load[width=64](0))
        var vb = bitcast[DType.uint16, 32](p.unsafe_load[width=64](64))
        var vc = bitcast[DType.uint16, 32](p.unsafe_load[width=64](128))
        var v = ((va >> 6) & 0x0303) | ((vb >> 4) & 0x0C0C) | ((vc >> 2) & 0x3030)
        return bitcast[DType.uint8, 64](v)


@always_inline
def _kx16_scale[fmt: Int](bp: U8Ptr, j: Int) -> Tuple[SIMD[DType.int16, 16], SIMD[DType.int16, 16]]:
    """Sub-block j's (sc_j, m_j) of the 16 rows: Q4_K's and Q5_K's 6-bit scale and min
    (see `_scale_min_k4`, one row a lane), Q6_K's int8 scale (and no min)."""
    comptime if fmt == Q4_K or fmt == Q5_K:
        var p = bp + 4 * GROUP  # byte i of the 12 at p + 16 i, one row a lane
        var a = (p + GROUP * (j % 4)).unsafe_load[width=GROUP](0)
        var m = (p + GROUP * (j % 4 + 4)).unsafe_load[width=GROUP](0)
        var c = (p + GROUP * (j % 4 + 8)).unsafe_load[width=GROUP](0)
        # Sub-blocks 4-7 take their low 4 bits from c and the top 2 from a's and m's.
        var high = j >= 4
        return (
            (((c & 0xF) | ((a >> 6) << 4)) if high else (a & 63)).cast[DType.int16](),
            (((c >> 4) | ((m >> 6) << 4)) if high else (m & 63)).cast[DType.int16](),
        )
    else:
        var sc = (bp + 2 * GROUP + GROUP * j).unsafe_bitcast[Int8]().unsafe_load[width=GROUP](0)
        return (sc.cast[DType.int16](), SIMD[DType.int16, 16](0))


@always_inline
def _tile_kx16[fmt: Int, terms: Int, mt: Int](
    xq: _X8[fmt, max(terms, 1)], x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr,
    K: Int, N: Int, m0: Int, g: Int, has_bias: Bool,
):
    """y[m0 : m0+mt, 16g : 16g+16] from group `g` of `kernels.interleave`'s layout."""
    comptime T = max(terms, 1)
    comptime GB = GROUP * block_bytes[fmt]()
    comptime SUB = _sub_elems[fmt]()
    comptime SUBS = 256 // SUB
    comptime COLS = SUB // 4
    comptime STEP = KX16_STEP[fmt]
    # The rows' d (and dmin) and scales, before the quants (`kernels.FIELDS`).
    comptime QOFF = GROUP * (16 if fmt == Q4_K else (48 if fmt == Q5_K else 18))
    # Two sums a row and term where there are few rows, so the dot products do not all
    # wait on one chain.
    comptime I16 = terms > 0 and not VNNI_DOT
    comptime P = 2 if mt * T < 4 and not I16 else 1
    # Q6_K's offset starts the integer sums (`_X8.offsets`); Q4_K's and Q5_K's mins,
    # and the float32 path's offset, are added per sub-block below.
    comptime OFFSET_INIT = fmt == Q6_K and terms > 0
    # The block's sums kept in integers (`whole`), each run scaled as it is widened.
    comptime INT = I16 and fmt == Q6_K
    # Where Q6_K's last quarter starts, taken a sub-block a trip (`Q6_LAST`); unrolled
    # with the rest of the block, its sub-blocks are told apart by their number.
    comptime SPLIT = Q6_LAST if fmt == Q6_K and STEP == 1 else SUBS
    var nb = K // 256
    var acc = Array[FV, mt](fill=0)
    var grp = w + g * nb * GB
    for blk in range(nb):
        var bp = grp + blk * GB
        var q = bp + QOFF
        var d = _halves(bp)
        var scaled = Array[FV, mt * T](fill=0)
        var whole = Array[IV, mt * T](fill=0)
        comptime for span in range(2):
            comptime START = 0 if span == 0 else SPLIT
            comptime END = SPLIT if span == 0 else SUBS
            comptime if START < END:
                for j0 in range(START, END, STEP):
                    comptime for jj in range(STEP):
                        comptime LAST = span == 1 or (fmt == Q6_K and jj >= Q6_LAST)
                        var j = j0 + jj
                        comptime STRIDE = GB * SUB // 256
                        comptime for line in range(0, STRIDE, 64):
                            prefetch[PrefetchOptions().for_read().medium_locality()](
                                bp + GROUP_PREFETCH + STRIDE * j + line
                            )
                        var sums = Array[AccV[terms], mt * T * P](fill=0)
                        # AVX2's byte products, summed in 16-bit lanes over a run of
                        # columns (`_I16_RUN`) and widened once a run (by the rows'
                        # scales with `INT`).
                        var runs = Array[SIMD[DType.int16, 32], mt * T](fill=0)
                        var by = SIMD[DType.int16, 32](1)
                        comptime if INT:
                            by = _pairs(_kx16_scale[fmt](bp, j)[0])
                        comptime if OFFSET_INIT:
                            comptime for i in range(mt):
                                comptime for t in range(T):
                                    var at = (((m0 + i) * nb + blk) * 16 + j) * T + t
                                    var start = xq.offsets.unsafe_load(at)
                                    comptime if I16:
                                        runs[i * T + t] = bitcast[DType.int16, 32](IV(start))
                                    else:
                                        sums[(i * T + t) * P] = AccV[terms](
                                            rebind[Scalar[AccV[terms].dtype]](start)
                                        )
                        comptime for k in range(COLS):
                            var col = _kx16_col[fmt, jj, k, LAST](q, j0)
                            comptime for i in range(mt):
                                var o = (m0 + i) * K + 256 * blk + SUB * j + 4 * k
                                comptime for t in range(T):
                                    comptime a = (i * T + t) * P + k % P
                                    comptime if I16:
                                        var xi = (xq.q if t == 0 else xq.lo) + o
                                        var xb = bitcast[DType.int8, 64](IV(xi.unsafe_bitcast[Int32]().unsafe_load(0)))
                                        runs[i * T + t] += _maddubs_avx2(col, xb)
                                        comptime if (k + 1) % _I16_RUN[fmt] == 0:
                                            comptime if INT:
                                                whole[i * T + t] += _widen_avx2(runs[i * T + t], by)
                                            else:
                                                sums[a] = rebind[AccV[terms]](
                                                    rebind[IV](sums[a]) + _widen_avx2(runs[i * T + t])
                                                )
                                            runs[i * T + t] = SIMD[DType.int16, 32](0)
                                    else:
                                        sums[a] = _mac4[terms](sums[a], col, xq.q if t == 0 else xq.lo, x, o)
                        var sm = _kx16_scale[fmt](bp, j)
                        comptime if not INT:
                            var sc = sm[0].cast[DType.float32]()
                            comptime for i in range(mt):
                                comptime for t in range(T):
                                    var s = sums[(i * T + t) * P]
                                    comptime if P == 2:
                                        s += sums[(i * T + t) * P + 1]
                                    scaled[i * T + t] = fma(s.cast[DType.float32](), sc, scaled[i * T + t])
                        comptime if not OFFSET_INIT:
                            # Each sub-block's sum of x, times its coefficient (see above).
                            var coeff: FV
                            comptime if fmt == Q4_K or fmt == Q5_K:
                                coeff = -_halves(bp + 2 * GROUP) * sm[1].cast[DType.float32]()
                            else:
                                coeff = -32 * d * sm[0].cast[DType.float32]()
                            comptime for i in range(mt):
                                var xs: Float32
                                comptime if terms == 0:
                                    xs = (x + (m0 + i) * K + 256 * blk + SUB * j).unsafe_load[width=SUB](0).reduce_add()
                                else:
                                    xs = xq.sums.unsafe_load(((m0 + i) * nb + blk) * SUBS + j)
                                acc[i] = fma(coeff, FV(xs), acc[i])
        comptime for i in range(mt):
            var s = whole[i * T].cast[DType.float32]() if INT else scaled[i * T]
            comptime if T == 2:
                var lo = whole[i * T + 1].cast[DType.float32]() if INT else scaled[i * T + 1]
                s = fma(lo, FV(1.0 / 254), s)
            var dx = xq.d.unsafe_load((m0 + i) * nb + blk) if terms else Float32(1)
            acc[i] = fma(s, d * dx, acc[i])
    comptime for i in range(mt):
        var s = acc[i]
        if has_bias:
            s += b.unsafe_load[width=GROUP](GROUP * g)
        y.unsafe_store((m0 + i) * N + GROUP * g, s)


def _packed_kx16[fmt: Int, terms: Int](
    x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr,
    M: Int, K: Int, N: Int, has_bias: Bool, team: Team, epi: Epilogue,
) raises:
    """A K-quant in `kernels.interleave`'s layout, with `terms` int8 terms of x, or
    (0) in float32; the rows past the last whole group in float32, as the file has them."""
    comptime T = max(terms, 1)
    comptime KMT = GROUP_MT[T]
    var xq = _X8[fmt, T](x, M if terms else 0, K, team)

    def group(m_begin: Int, m_end: Int, g: Int) {imm xq, imm x, imm w, imm b, imm y, imm K, imm N, imm has_bias}:
        var m0 = m_begin
        while m0 + KMT <= m_end:
            _tile_kx16[fmt, terms, KMT](xq, x, w, b, y, K, N, m0, g, has_bias)
            m0 += KMT
        comptime for rest in range(1, KMT):
            if m_end - m0 == rest:
                _tile_kx16[fmt, terms, rest](xq, x, w, b, y, K, N, m0, g, has_bias)

    def tail(m_begin: Int, m_end: Int, n: Int) {imm x, imm w, imm b, imm y, imm K, imm N, imm has_bias}:
        _row[fmt](x, w, b, y, K, N, m_begin, m_end, n, has_bias)

    _share_groups(group, tail, y, M, N, team, epi)
    xq.free()


comptime DOT_AUTO = 0
comptime DOT_F32 = 1
comptime DOT_INT8 = 2
comptime DOT_INT8X2 = 3


def dot_path[fmt: Int, dot: Int]() -> Int:
    """The arithmetic of every step: for DOT_AUTO the fastest this CPU has for the
    format, at the rounding the format needs; a named one if the CPU and the format have
    it, else float32 (the exact one: a test of a named path then holds wherever it
    runs). int8 needs bytes multiplied (INT8_DOT)."""
    comptime if dot == DOT_AUTO:
        comptime if not INT8_DOT:
            return DOT_F32
        # Q4_K, Q6_K and Q4_0 round x once, as MAX's kernel and llama.cpp's do (Q4_0's
        # per block of 32, as ggml's Q8_0 activations); Q5_K's QKV projections need the
        # second term (see above), and Q5_0, Q5_1 and Q8_0 keep it.
        return DOT_INT8 if fmt == Q4_K or fmt == Q6_K or fmt == Q4_0 else DOT_INT8X2
    if (dot == DOT_INT8 or dot == DOT_INT8X2) and INT8_DOT:
        return dot
    return DOT_F32


def packed_matmul[fmt: Int, dot: Int](
    x: F32Ptr, w: U8Ptr, b: F32Ptr, y: F32Ptr,
    M: Int, K: Int, N: Int, has_bias: Bool, team: Team, epi: Epilogue,
) raises:
    comptime path = dot_path[fmt, dot]()
    comptime terms = 2 if path == DOT_INT8X2 else (1 if path == DOT_INT8 else 0)
    comptime if block_elems[fmt]() == 256:
        _packed_kx16[fmt, terms](x, w, b, y, M, K, N, has_bias, team, epi)
    else:
        _packed_b32x16[fmt, terms](x, w, b, y, M, K, N, has_bias, team, epi)
