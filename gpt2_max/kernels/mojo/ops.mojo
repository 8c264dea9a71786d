"""MAX registrations of the float linear ops (`skinny.mojo`, MAX's CPU matmul), the
packed-weight matmul (`kquant.mojo`) and attention over the paged KV cache
(`attention.mojo`).

The linear ops take float32 or float16 weights (`wdt`, bound from the weight's type),
the packed ops GGUF blocks (`fmt`, the GGML type id, a declared parameter) and
`dot`, the arithmetic (`kquant.dot_path`: 0 for the CPU's fastest);
activations, bias and output are float32 either way.

A linear op picks its kernel from the step's row count as it runs, so a graph stages
one op per projection and serves decode and prefill alike: up to `max_rows` rows
(declared by the caller, `kernels.SKINNY_MAX_ROWS`) the skinny kernel, which streams
the weights once; past it, for float32 weights, MAX's tiled CPU matmul (`linalg`), the
kernel MAX's own graph matmul runs, which reuses each packed weight tile across many
rows. Choosing here rather than with a graph-level branch per projection saves a
conditional's fixed cost on every projection of every decode step. Float16 weights
stay on the skinny kernel at every size: MAX's matmul multiplies float32 by float32
only.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from layout import Coord, TileTensor, coord_to_index_list
from layout.tile_layout import row_major
from linalg.matmul import matmul as max_matmul
from max.gpu.host import DeviceContext
from max.runtime.asyncrt import parallelism_level

from .attention import U32Ptr, paged_attention
from .kquant import U8Ptr, packed_matmul, packed_row_bytes
from .share import CpuCtx, Epilogue, F32Ptr, Team
from .skinny import WPtr, skinny_matmul


def run_linear[wdt: DType, max_rows: Int, lines: Bool = False](
    y: F32Ptr, x: F32Ptr, w: WPtr[wdt], b: F32Ptr,
    M: Int, K: Int, N: Int, has_bias: Bool,
) raises:
    """`y = x @ w.T (+ b)`: MAX's tiled matmul for more than `max_rows` rows of float32
    weights held row-major, else the skinny kernel (weights in `lines` or not)."""
    comptime if wdt == DType.float32 and not lines:
        if M > max_rows:
            _tiled(y, x, rebind[F32Ptr](w), b, M, K, N, has_bias)
            return
    var cpu = Optional[CpuCtx](None)
    skinny_matmul[wdt, lines](x, w, b, y, M, K, N, has_bias, max(1, parallelism_level(cpu)), cpu)


def _tiled(
    y: F32Ptr, x: F32Ptr, w: F32Ptr, b: F32Ptr, M: Int, K: Int, N: Int, has_bias: Bool
) raises:
    """MAX's CPU matmul on `w` as stored (`[N, K]`, hence `transpose_b`), the bias added
    to each tile as it is stored rather than in a second pass over `y`."""
    var yt = TileTensor(y, row_major(Coord(M, N)))
    var xt = TileTensor(x, row_major(Coord(M, K))).as_immut()
    var wt = TileTensor(w, row_major(Coord(N, K))).as_immut()

    @parameter
    @always_inline
    def add_bias[dtype: DType, width: SIMDLength, *, alignment: Int = 1](
        coords: Coord, val: SIMD[dtype, width]
    ) -> SIMD[dtype, width]:
        var mn = coord_to_index_list(coords)
        return val + b.unsafe_load[width=width](mn[1]).cast[dtype]()

    if has_bias:
        max_matmul[transpose_b=True, elementwise_compute_lambda_fn=add_bias](yt, xt, wt, None)
    else:
        max_matmul[transpose_b=True](yt, xt, wt, None)


@extensibility.register("gpt2_skinny_linear")
struct SkinnyLinear:
    """y[M, N] = x[M, K] @ w[N, K]^T + b[N]."""

    @staticmethod
    def execute[wdt: DType, max_rows: Int, lines: Bool, target: StaticString](
        y: OutputTensor[dtype=DType.float32, rank=2, static_spec=_],
        x: InputTensor[dtype=DType.float32, rank=2, static_spec=_],
        w: InputTensor[dtype=wdt, rank=2, static_spec=_],
        b: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        run_linear[wdt, max_rows, lines](
            rebind[F32Ptr](y.unsafe_ptr()), rebind[F32Ptr](x.unsafe_ptr()),
            rebind[WPtr[wdt]](w.unsafe_ptr()), rebind[F32Ptr](b.unsafe_ptr()),
            x.dim_size(0), x.dim_size(1), w.dim_size(0), True,
        )


@extensibility.register("gpt2_skinny_matmul")
struct SkinnyMatmul:
    """y[M, N] = x[M, K] @ w[N, K]^T."""

    @staticmethod
    def execute[wdt: DType, max_rows: Int, target: StaticString](
        y: OutputTensor[dtype=DType.float32, rank=2, static_spec=_],
        x: InputTensor[dtype=DType.float32, rank=2, static_spec=_],
        w: InputTensor[dtype=wdt, rank=2, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var xp = rebind[F32Ptr](x.unsafe_ptr())
        # No bias: neither kernel reads `b` when has_bias is False.
        run_linear[wdt, max_rows](
            rebind[F32Ptr](y.unsafe_ptr()), xp, rebind[WPtr[wdt]](w.unsafe_ptr()),
            xp, x.dim_size(0), x.dim_size(1), w.dim_size(0), False,
        )


def _run_packed[fmt: Int, dot: Int](
    y: F32Ptr, x: F32Ptr, w: U8Ptr, b: F32Ptr,
    M: Int, K: Int, N: Int, row_bytes: Int, has_bias: Bool,
) raises:
    if row_bytes != packed_row_bytes[fmt](K):
        raise Error(
            "packed weight rows of ", row_bytes, " bytes do not hold K=", K,
            " values of GGML type ", fmt,
        )
    var cpu = Optional[CpuCtx](None)
    packed_matmul[fmt, dot](
        x, w, b, y, M, K, N, has_bias, Team.launch(parallelism_level(cpu), cpu), Epilogue.none()
    )


@extensibility.register("gpt2_packed_linear")
struct PackedLinear:
    """y[M, N] = x[M, K] @ dequant(w)[N, K]^T + b[N], `w` GGUF blocks of GGML type
    `fmt` as `kernels.interleave` lays them out (see `kquant.mojo`)."""

    @staticmethod
    def execute[fmt: Int, dot: Int, target: StaticString](
        y: OutputTensor[dtype=DType.float32, rank=2, static_spec=_],
        x: InputTensor[dtype=DType.float32, rank=2, static_spec=_],
        w: InputTensor[dtype=DType.uint8, rank=2, static_spec=_],
        b: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        _run_packed[fmt, dot](
            rebind[F32Ptr](y.unsafe_ptr()), rebind[F32Ptr](x.unsafe_ptr()),
            rebind[U8Ptr](w.unsafe_ptr()), rebind[F32Ptr](b.unsafe_ptr()),
            x.dim_size(0), x.dim_size(1), w.dim_size(0), w.dim_size(1), True,
        )


@extensibility.register("gpt2_packed_matmul")
struct PackedMatmul:
    """y[M, N] = x[M, K] @ dequant(w)[N, K]^T, `w` GGUF blocks of GGML type `fmt`."""

    @staticmethod
    def execute[fmt: Int, dot: Int, target: StaticString](
        y: OutputTensor[dtype=DType.float32, rank=2, static_spec=_],
        x: InputTensor[dtype=DType.float32, rank=2, static_spec=_],
        w: InputTensor[dtype=DType.uint8, rank=2, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var xp = rebind[F32Ptr](x.unsafe_ptr())
        # No bias: the kernel never reads `b` when has_bias is False.
        _run_packed[fmt, dot](
            rebind[F32Ptr](y.unsafe_ptr()), xp, rebind[U8Ptr](w.unsafe_ptr()), xp,
            x.dim_size(0), x.dim_size(1), w.dim_size(0), w.dim_size(1), False,
        )


@extensibility.register("gpt2_paged_attention")
struct PagedAttention:
    """y[t, h] = causal attention of q[t, h] over layer `layer_idx` of MAX's paged KV
    cache (see `attention.mojo`). The cache is an in-place operand, so the graph orders
    this op after the stores that wrote the step's keys and values."""

    @staticmethod
    def execute[head_dim: Int, target: StaticString](
        y: OutputTensor[dtype=DType.float32, rank=3, static_spec=_],
        q: InputTensor[dtype=DType.float32, rank=3, static_spec=_],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, static_spec=_],
        kv_blocks: MutableInputTensor[dtype=DType.float32, rank=6, static_spec=_],
        page_stride: InputTensor[dtype=DType.int64, rank=1, static_spec=_],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, static_spec=_],
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, static_spec=_],
        layer_idx: UInt32,
        scale: Float32,
        ctx: DeviceContext,
    ) raises:
        if q.dim_size(2) != head_dim or kv_blocks.dim_size(5) != head_dim:
            raise Error("attention heads of ", q.dim_size(2), " values, cache heads of ",
                        kv_blocks.dim_size(5), ", op built for ", head_dim)
        if kv_blocks.dim_size(1) != 2 or q.dim_size(1) % kv_blocks.dim_size(4):
            raise Error("the cache holds no separate keys and values for these heads")
        var stride = Int(page_stride.unsafe_ptr().load(0))
        var page_elems = 2 * kv_blocks.dim_size(2) * kv_blocks.dim_size(3) * kv_blocks.dim_size(4) * head_dim
        var cpu = Optional[CpuCtx](None)
        paged_attention[head_dim](
            rebind[F32Ptr](y.unsafe_ptr()), rebind[F32Ptr](q.unsafe_ptr()),
            rebind[U32Ptr](input_row_offsets.unsafe_ptr()), input_row_offsets.dim_size(0) - 1,
            q.dim_size(1), rebind[F32Ptr](kv_blocks.unsafe_ptr()),
            page_elems if stride < 0 else stride, kv_blocks.dim_size(2), kv_blocks.dim_size(3),
            kv_blocks.dim_size(4), Int(layer_idx), rebind[U32Ptr](cache_lengths.unsafe_ptr()),
            rebind[U32Ptr](lookup_table.unsafe_ptr()), lookup_table.dim_size(1), scale,
            max(1, parallelism_level(cpu)), cpu,
        )
