"""One GPT-2 block as one op, CPU: LayerNorm, attention over the paged KV cache, the
MLP, both residual adds.

A decode step's projections stream their weights from memory, and between two ops
MAX's executor hands the next op to its workers: a pause at every boundary in which
at most one core streams, and a block composed of its modules has a dozen of them
(`docs/performance.md`, "One op a block"). A step of up to `max_rows` rows therefore
runs a whole block in one `sync_parallelize`: every task goes through the block's
stages in order, sharing out each projection's chunks as `share.share_out` does,
and meets the others at a barrier wherever a stage reads what all of them wrote. A
longer step (a prefill) runs the same stages one after the other, each on all the
threads, the projections through `ops.run_linear` (MAX's tiled matmul for float32
weights) or the packed kernel, as the composed block does.

The projections are float32 or float16, or GGUF blocks of any type the packed kernel
multiplies (`kquant.mojo`), each its own: a packed projection runs the packed op's
kernel, every task of the region joining it as a member of its team
(`share.Team.joined`) with the stage's residual add or GELU done on each chunk of
outputs (`share.Epilogue`), so a quantized model's block is one op too.

Each value is computed as `layers.block.GPT2Block.forward` computes it (the projections in
the skinny kernel's order, the bias and then the residual added to each sum, the
same tanh GELU), so the two differ only by LayerNorm's and GELU's rounding.
"""

from std.atomic import Atomic
from std.math import ceildiv, fma, sqrt
from std.ffi import external_call
from std.os import abort
from std.sys import simd_width_of, size_of

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.runtime.asyncrt import parallelism_level

from .attention import AttentionPlan, U32Ptr, attention_tasks, plan_attention, run_attention
from .kquant import U8Ptr, packed_matmul, packed_row_bytes
from .ops import run_linear
from .share import (
    Counters, CpuCtx, Epilogue, F32Ptr, Team, add_into, gelu_in_place, share_out,
)
from .skinny import R, WPtr, _block, line_values

comptime SW = simd_width_of[DType.float32]()
comptime PAD = 8
"""Int64s between two shared counters: one cache line each, so one task's claims do not
take the line another task's counter sits on."""
comptime CHUNK_BYTES = 64 * 1024
"""Weight bytes per chunk, the unit the tasks share: every stage ends at a barrier,
where a task waits for the other's last chunk, so chunks are cut by bytes (an MLP
output row is four times an input row's) and smaller than `skinny`'s."""
comptime SPINS = 4096
"""Barrier polls before a waiting task yields its core (to a preempted task, which it
waits for)."""


@always_inline
def _layer_norm(x: F32Ptr, g: F32Ptr, b: F32Ptr, dst: F32Ptr, K: Int, eps: Float32):
    """One row: (x - mean) / sqrt(var + eps) * g + b, the variance about the mean."""
    var kv = (K // SW) * SW
    var acc = SIMD[DType.float32, SW](0)
    for k in range(0, kv, SW):
        acc += x.unsafe_load[width=SW](k)
    var total = acc.reduce_add()
    for k in range(kv, K):
        total += x.unsafe_load(k)
    var mean = total / Float32(K)
    var sq = SIMD[DType.float32, SW](0)
    for k in range(0, kv, SW):
        var d = x.unsafe_load[width=SW](k) - mean
        sq = fma(d, d, sq)
    var var_ = sq.reduce_add()
    for k in range(kv, K):
        var d = x.unsafe_load(k) - mean
        var_ += d * d
    var inv = 1 / sqrt(var_ / Float32(K) + eps)
    for k in range(0, kv, SW):
        var d = (x.unsafe_load[width=SW](k) - mean) * inv
        dst.unsafe_store(k, fma(d, g.unsafe_load[width=SW](k), b.unsafe_load[width=SW](k)))
    for k in range(kv, K):
        dst.unsafe_store(k, (x.unsafe_load(k) - mean) * inv * g.unsafe_load(k) + b.unsafe_load(k))


@fieldwise_init
struct Block[
    wdt: DType, f_qkv: Int, f_o: Int, f_fc: Int, f_p: Int, dot: Int, lines: Bool
](ImplicitlyCopyable, Movable):
    """A block's parameters and the step's buffers; every pointer is shared by the tasks.

    The projections' weights are float (`wdt` float32 or float16, every `f_*` 0) or GGUF
    blocks (`wdt` uint8, `f_qkv` ... `f_p` each projection's GGML type, multiplied with
    the packed kernel's arithmetic `dot`, `kquant.dot_path`). Float weights are held
    row-major, or in lines (`lines`, `skinny.mojo`)."""

    var x: F32Ptr
    """[M, d], the residual stream in."""
    var y: F32Ptr
    """[M, d], out."""
    var ln1_g: F32Ptr
    var ln1_b: F32Ptr
    var w_qkv: WPtr[Self.wdt]
    var b_qkv: F32Ptr
    var w_o: WPtr[Self.wdt]
    var b_o: F32Ptr
    var ln2_g: F32Ptr
    var ln2_b: F32Ptr
    var w_fc: WPtr[Self.wdt]
    var b_fc: F32Ptr
    var w_p: WPtr[Self.wdt]
    var b_p: F32Ptr
    var M: Int
    var d: Int
    var ff: Int
    var eps: Float32
    var qkv: F32Ptr
    """[M, 3d]."""
    var q: F32Ptr
    """[M, d], the queries, contiguous for attention."""
    var o: F32Ptr
    """[M, d], attention's output."""
    var h: F32Ptr
    """[M, d], x plus the attention block."""
    var f: F32Ptr
    """[M, ff], the MLP's activations."""

    def project[fmt: Int](
        self, x: F32Ptr, w: WPtr[Self.wdt], b: F32Ptr, dst: F32Ptr, K: Int, N: Int,
        team: Team, epi: Epilogue,
    ):
        """`dst = x @ w.T + b` for the block's `M` rows, then `epi`, each chunk by one of
        the team's tasks: float weights (`fmt` 0) in `project_chunk`'s chunks, GGUF
        blocks of GGML type `fmt` through the packed kernel (`kquant.packed_matmul`, as
        `kernels.interleave` lays them out), as the packed ops run it."""
        try:
            comptime if fmt == 0:

                def chunk(c: Int) {imm self, imm x, imm w, imm b, imm dst, imm K, imm N, imm epi}:
                    self.project_chunk(x, w, b, dst, K, N, c, epi)

                share_out(chunk, chunks[Self.wdt](N, K), team)
            else:
                packed_matmul[fmt, Self.dot](
                    x, rebind[U8Ptr](w), b, dst, self.M, K, N, True, team, epi
                )
        except e:
            # A joined team starts no tasks, the one thing here that raises.
            abort(String("a block's projection failed: ", e))

    def project_chunk(
        self, x: F32Ptr, w: WPtr[Self.wdt], b: F32Ptr, dst: F32Ptr, K: Int, N: Int,
        c: Int, epi: Epilogue,
    ):
        """Chunk `c` of `out = x @ w.T + b` (`chunk_blocks` blocks of `R` rows of `w`),
        then `epi` over the chunk's columns."""
        var nblocks = N // R
        var cb = chunk_blocks[Self.wdt](K)
        var n0 = c * cb * R
        var n1 = min((c + 1) * cb, nblocks) * R
        for blk in range(c * cb, min((c + 1) * cb, nblocks)):
            _block[Self.wdt, R, Self.lines](x, w, b, dst, self.M, K, N, blk * R, True)
        if n1 == nblocks * R:
            for n in range(nblocks * R, N):
                _block[Self.wdt, 1](x, w, b, dst, self.M, K, N, n, True)
            n1 = N
        epi.apply(dst, N, 0, self.M, n0, n1)

    def stage[fmt: Int, max_rows: Int](
        self, dst: F32Ptr, x: F32Ptr, w: WPtr[Self.wdt], b: F32Ptr, K: Int, N: Int,
        ntasks: Int, ctx: Optional[CpuCtx],
    ) raises:
        """`dst = x @ w.T + b` for a prefill's rows on all the threads, as the composed
        block's op for the weight computes it (`ops.run_linear`, the packed ops)."""
        comptime if fmt == 0:
            run_linear[Self.wdt, max_rows, Self.lines](dst, x, w, b, self.M, K, N, True)
        else:
            packed_matmul[fmt, Self.dot](
                x, rebind[U8Ptr](w), b, dst, self.M, K, N, True, Team.launch(ntasks, ctx),
                Epilogue.none(),
            )

    def layer_norm_rows(self, x: F32Ptr, g: F32Ptr, b: F32Ptr, dst: F32Ptr, m0: Int, m1: Int):
        for m in range(m0, m1):
            _layer_norm(x + m * self.d, g, b, dst + m * self.d, self.d, self.eps)


def chunk_blocks[wdt: DType](K: Int) -> Int:
    """Blocks of `R` weight rows of `K` values in a chunk."""
    return max(1, CHUNK_BYTES // (R * K * size_of[wdt]()))


def chunks[wdt: DType](N: Int, K: Int) -> Int:
    """Chunks of an `[N, K]` weight."""
    return max(1, ceildiv(N // R, chunk_blocks[wdt](K)))


@always_inline
def _wait(arrived: UnsafePointer[Atomic[Int64], MutUntrackedOrigin], goal: Int):
    """Arrives at the barrier and waits until `goal` arrivals in all (the counter only
    grows: the n-th barrier of T tasks waits for n * T)."""
    _ = arrived[0].fetch_add(1)
    var spins = 0
    while Int(arrived[0].load()) < goal:
        spins += 1
        if spins == SPINS:
            spins = 0
            _ = external_call["sched_yield", Int32]()


def _store_rows[D: Int](plan: AttentionPlan[D], q: F32Ptr, qkv: F32Ptr, d: Int, b: Int):
    """Sequence `b`'s rows: queries into `q`, keys and values into the cache behind what
    it held (as `store_k/v_cache_ragged` write them), where `plan`'s attention reads
    them."""
    var first = Int(plan.offsets.unsafe_load(b))
    var last = Int(plan.offsets.unsafe_load(b + 1))
    var cached = Int(plan.cache_lengths.unsafe_load(b))
    var pages = plan.pages(b, 0)
    for r in range(first, last):
        var pos = cached + r - first
        var key = pages.key(pos // pages.page_size, pos % pages.page_size)
        var value = pages.value(pos // pages.page_size, pos % pages.page_size)
        var src = qkv + r * 3 * d
        for k in range(d):
            q.unsafe_store(r * d + k, src.unsafe_load(k))
            key.unsafe_store(k, src.unsafe_load(d + k))
            value.unsafe_store(k, src.unsafe_load(2 * d + k))


def _member(t: Int, T: Int, counters: Counters, stage: Int) -> Team:
    """Task `t` of `T` in projection `stage`'s team, claiming from that stage's counters."""
    return Team.joined(t, T, counters + stage * T * PAD, PAD)


def decoder_block[
    wdt: DType, f_qkv: Int, f_o: Int, f_fc: Int, f_p: Int, dot: Int, lines: Bool, //,
    head_dim: Int, max_rows: Int,
](
    blk: Block[wdt, f_qkv, f_o, f_fc, f_p, dot, lines], offsets: U32Ptr, B: Int, H: Int,
    blocks: F32Ptr, page_elems: Int, L: Int, page_size: Int, layer: Int,
    cache_lengths: U32Ptr, lut: U32Ptr, lut_cols: Int, scale: Float32, ntasks: Int,
    ctx: Optional[CpuCtx],
) raises:
    """`blk.y = h + mlp(ln_2(h))`, `h = blk.x + attn(ln_1(blk.x))`, the step's keys and
    values stored into layer `layer` of the cache (`H` heads of `head_dim`, one kv head
    each)."""
    var d = blk.d
    var M = blk.M
    if M > max_rows:
        _staged[head_dim, max_rows](
            blk, offsets, B, H, blocks, page_elems, L, page_size, layer, cache_lengths,
            lut, lut_cols, scale, ntasks, ctx,
        )
        return
    var T = max(1, ntasks)
    var plan = plan_attention[head_dim](
        blk.o, blk.q, offsets, B, H, blocks, page_elems, L, page_size, H, layer,
        cache_lengths, lut, lut_cols, scale, T,
    )
    # Four shared-out projections, then the barrier's counter.
    var shared = alloc[Int64](5 * T * PAD, alignment=64)
    for i in range(5 * T * PAD):
        shared.unsafe_store(i, 0)
    var counters = shared.unsafe_bitcast[Atomic[Int64]]()
    var arrived = counters + 4 * T * PAD
    var ln = alloc[Float32](T * M * d, alignment=64)

    def task(t: Int) {
        imm blk, imm B, imm d, imm M, imm plan, imm counters, imm arrived, imm ln, imm T,
    }:
        var mine = ln + t * M * d
        blk.layer_norm_rows(blk.x, blk.ln1_g, blk.ln1_b, mine, 0, M)
        blk.project[f_qkv](
            mine, blk.w_qkv, blk.b_qkv, blk.qkv, d, 3 * d, _member(t, T, counters, 0),
            Epilogue.none(),
        )
        _wait(arrived, T)
        for b in range(t, B, T):
            _store_rows(plan, blk.q, blk.qkv, d, b)
        _wait(arrived, 2 * T)
        plan.run(t, T)
        _wait(arrived, 3 * T)
        blk.project[f_o](
            blk.o, blk.w_o, blk.b_o, blk.h, d, d, _member(t, T, counters, 1),
            Epilogue.add(blk.x),
        )
        _wait(arrived, 4 * T)
        blk.layer_norm_rows(blk.h, blk.ln2_g, blk.ln2_b, mine, 0, M)
        blk.project[f_fc](
            mine, blk.w_fc, blk.b_fc, blk.f, d, blk.ff, _member(t, T, counters, 2),
            Epilogue.gelu_tanh(),
        )
        _wait(arrived, 5 * T)
        blk.project[f_p](
            blk.f, blk.w_p, blk.b_p, blk.y, blk.ff, d, _member(t, T, counters, 3),
            Epilogue.add(blk.h),
        )

    sync_parallelize(task, T, ctx)
    ln.free()
    shared.free()
    plan.free()


def _rows_parallel[Work: def(Int, Int) -> None](work: Work, M: Int, ntasks: Int, ctx: Optional[CpuCtx]) raises:
    """`work(m0, m1)` over `M` rows cut into `ntasks` bands."""
    var T = max(1, min(ntasks, M))

    def band(t: Int) {imm work, imm M, imm T}:
        work(t * M // T, (t + 1) * M // T)

    sync_parallelize(band, T, ctx)


def _staged[
    wdt: DType, f_qkv: Int, f_o: Int, f_fc: Int, f_p: Int, dot: Int, lines: Bool, //,
    head_dim: Int, max_rows: Int,
](
    blk: Block[wdt, f_qkv, f_o, f_fc, f_p, dot, lines], offsets: U32Ptr, B: Int, H: Int,
    blocks: F32Ptr, page_elems: Int, L: Int, page_size: Int, layer: Int,
    cache_lengths: U32Ptr, lut: U32Ptr, lut_cols: Int, scale: Float32, ntasks: Int,
    ctx: Optional[CpuCtx],
) raises:
    """The block for many rows, a stage at a time, each on all the threads."""
    var d = blk.d
    var M = blk.M
    var ff = blk.ff
    var ln = alloc[Float32](M * d, alignment=64)

    def ln1(m0: Int, m1: Int) {imm blk, imm ln}:
        blk.layer_norm_rows(blk.x, blk.ln1_g, blk.ln1_b, ln, m0, m1)

    _rows_parallel(ln1, M, ntasks, ctx)
    blk.stage[f_qkv, max_rows](blk.qkv, ln, blk.w_qkv, blk.b_qkv, d, 3 * d, ntasks, ctx)
    var tasks = attention_tasks(offsets, B, cache_lengths, H, head_dim, ntasks)
    var plan = plan_attention[head_dim](
        blk.o, blk.q, offsets, B, H, blocks, page_elems, L, page_size, H, layer,
        cache_lengths, lut, lut_cols, scale, tasks,
    )
    for b in range(B):
        _store_rows(plan, blk.q, blk.qkv, d, b)
    run_attention(plan, tasks, ctx)
    plan.free()
    blk.stage[f_o, max_rows](blk.h, blk.o, blk.w_o, blk.b_o, d, d, ntasks, ctx)

    def residual_ln2(m0: Int, m1: Int) {imm blk, imm ln, imm d}:
        add_into(blk.h, blk.x, m0 * d, m1 * d)
        blk.layer_norm_rows(blk.h, blk.ln2_g, blk.ln2_b, ln, m0, m1)

    _rows_parallel(residual_ln2, M, ntasks, ctx)
    blk.stage[f_fc, max_rows](blk.f, ln, blk.w_fc, blk.b_fc, d, ff, ntasks, ctx)

    def gelu(m0: Int, m1: Int) {imm blk, imm ff}:
        gelu_in_place(blk.f, m0 * ff, m1 * ff)

    _rows_parallel(gelu, M, ntasks, ctx)
    blk.stage[f_p, max_rows](blk.y, blk.f, blk.w_p, blk.b_p, ff, d, ntasks, ctx)

    def residual(m0: Int, m1: Int) {imm blk, imm d}:
        add_into(blk.y, blk.h, m0 * d, m1 * d)

    _rows_parallel(residual, M, ntasks, ctx)
    ln.free()


def _row_width[wdt: DType, fmt: Int](K: Int) raises -> Int:
    """Elements of `wdt` in a weight row of `K` values: `K` floats (`fmt` 0), or the bytes
    of GGML type `fmt`'s blocks of them."""
    comptime if fmt == 0:
        if wdt == DType.uint8:
            raise Error("weights of bytes with no GGML type")
        return K
    else:
        if wdt != DType.uint8:
            raise Error("GGML type ", fmt, " given for weights of ", wdt)
        return packed_row_bytes[fmt](K)


@extensibility.register("gpt2_decoder_block")
struct DecoderBlock:
    """y = h + mlp(ln_2(h)), h = x + attn(ln_1(x)) for one GPT-2 block (`decoder_block`),
    the step's keys and values written into layer `layer_idx` of MAX's paged cache."""

    @staticmethod
    def execute[
        wdt: DType, head_dim: Int, max_rows: Int, f_qkv: Int, f_o: Int, f_fc: Int, f_p: Int,
        dot: Int, lines: Bool, target: StaticString,
    ](
        y: OutputTensor[dtype=DType.float32, rank=2, static_spec=_],
        x: InputTensor[dtype=DType.float32, rank=2, static_spec=_],
        ln1_g: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        ln1_b: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        w_qkv: InputTensor[dtype=wdt, rank=2, static_spec=_],
        b_qkv: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        w_o: InputTensor[dtype=wdt, rank=2, static_spec=_],
        b_o: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        ln2_g: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        ln2_b: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        w_fc: InputTensor[dtype=wdt, rank=2, static_spec=_],
        b_fc: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        w_p: InputTensor[dtype=wdt, rank=2, static_spec=_],
        b_p: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, static_spec=_],
        kv_blocks: MutableInputTensor[dtype=DType.float32, rank=6, static_spec=_],
        page_stride: InputTensor[dtype=DType.int64, rank=1, static_spec=_],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, static_spec=_],
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, static_spec=_],
        layer_idx: UInt32,
        scale: Float32,
        eps: Float32,
        ctx: DeviceContext,
    ) raises:
        var M = x.dim_size(0)
        var d = x.dim_size(1)
        var ff = w_fc.dim_size(0)
        if (
            w_qkv.dim_size(0) != 3 * d or w_o.dim_size(0) != d or w_p.dim_size(0) != d
            or w_qkv.dim_size(1) != _row_width[wdt, f_qkv](d)
            or w_o.dim_size(1) != _row_width[wdt, f_o](d)
            or w_fc.dim_size(1) != _row_width[wdt, f_fc](d)
            or w_p.dim_size(1) != _row_width[wdt, f_p](ff)
        ):
            raise Error("the block's weights do not fit a hidden size of ", d)
        comptime if lines:
            if d % line_values[wdt]() or ff % line_values[wdt]():
                raise Error("weights in lines need rows of a multiple of ", line_values[wdt](),
                            " values, not ", d, " and ", ff)
        if kv_blocks.dim_size(5) != head_dim or d % head_dim or kv_blocks.dim_size(4) * head_dim != d:
            raise Error("cache heads of ", kv_blocks.dim_size(4), " x ", kv_blocks.dim_size(5),
                        " values, hidden size ", d, ", op built for heads of ", head_dim)
        if kv_blocks.dim_size(1) != 2:
            raise Error("the cache holds no separate keys and values")
        var stride = Int(page_stride.unsafe_ptr().load(0))
        var page_elems = 2 * kv_blocks.dim_size(2) * kv_blocks.dim_size(3) * d
        var qkv = alloc[Float32](M * 3 * d, alignment=64)
        var q = alloc[Float32](M * d, alignment=64)
        var o = alloc[Float32](M * d, alignment=64)
        var h = alloc[Float32](M * d, alignment=64)
        var f = alloc[Float32](M * ff, alignment=64)
        var blk = Block[wdt, f_qkv, f_o, f_fc, f_p, dot, lines](
            rebind[F32Ptr](x.unsafe_ptr()), rebind[F32Ptr](y.unsafe_ptr()),
            rebind[F32Ptr](ln1_g.unsafe_ptr()), rebind[F32Ptr](ln1_b.unsafe_ptr()),
            rebind[WPtr[wdt]](w_qkv.unsafe_ptr()), rebind[F32Ptr](b_qkv.unsafe_ptr()),
            rebind[WPtr[wdt]](w_o.unsafe_ptr()), rebind[F32Ptr](b_o.unsafe_ptr()),
            rebind[F32Ptr](ln2_g.unsafe_ptr()), rebind[F32Ptr](ln2_b.unsafe_ptr()),
            rebind[WPtr[wdt]](w_fc.unsafe_ptr()), rebind[F32Ptr](b_fc.unsafe_ptr()),
            rebind[WPtr[wdt]](w_p.unsafe_ptr()), rebind[F32Ptr](b_p.unsafe_ptr()),
            M, d, ff, eps, qkv, q, o, h, f,
        )
        var cpu = Optional[CpuCtx](None)
        decoder_block[head_dim, max_rows](
            blk, rebind[U32Ptr](input_row_offsets.unsafe_ptr()), input_row_offsets.dim_size(0) - 1,
            d // head_dim, rebind[F32Ptr](kv_blocks.unsafe_ptr()),
            page_elems if stride < 0 else stride, kv_blocks.dim_size(2), kv_blocks.dim_size(3),
            Int(layer_idx), rebind[U32Ptr](cache_lengths.unsafe_ptr()),
            rebind[U32Ptr](lookup_table.unsafe_ptr()), lookup_table.dim_size(1), scale,
            max(1, parallelism_level(cpu)), cpu,
        )
        qkv.free()
        q.free()
        o.free()
        h.free()
        f.free()
