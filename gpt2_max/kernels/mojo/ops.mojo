"""MAX registrations of the skinny matmul (`skinny.mojo`) and the packed-weight
matmul (`kquant.mojo`).

The skinny ops take float32 or float16 weights (`wdt`, bound from the weight's type),
the packed ops GGUF blocks (`fmt`, the GGML type id, a declared parameter) and
`dot`, the decode steps' arithmetic (`kquant.decode_dot`: 0 for the CPU's fastest);
activations, bias and output are float32 either way.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from max.runtime.asyncrt import parallelism_level

from .kquant import U8Ptr, block_bytes, block_elems, packed_matmul
from .skinny import CpuCtx, F32Ptr, WPtr, skinny_matmul


def _run[wdt: DType](
    y: F32Ptr, x: F32Ptr, w: WPtr[wdt], b: F32Ptr,
    M: Int, K: Int, N: Int, has_bias: Bool, ctx: DeviceContext,
) raises:
    var cpu = Optional[CpuCtx](None)
    skinny_matmul[wdt](x, w, b, y, M, K, N, has_bias, max(1, parallelism_level(cpu)), cpu)


@extensibility.register("gpt2_skinny_linear")
struct SkinnyLinear:
    """y[M, N] = x[M, K] @ w[N, K]^T + b[N]."""

    @staticmethod
    def execute[wdt: DType, target: StaticString](
        y: OutputTensor[dtype=DType.float32, rank=2, static_spec=_],
        x: InputTensor[dtype=DType.float32, rank=2, static_spec=_],
        w: InputTensor[dtype=wdt, rank=2, static_spec=_],
        b: InputTensor[dtype=DType.float32, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        _run[wdt](
            rebind[F32Ptr](y.unsafe_ptr()), rebind[F32Ptr](x.unsafe_ptr()),
            rebind[WPtr[wdt]](w.unsafe_ptr()), rebind[F32Ptr](b.unsafe_ptr()),
            x.dim_size(0), x.dim_size(1), w.dim_size(0), True, ctx,
        )


@extensibility.register("gpt2_skinny_matmul")
struct SkinnyMatmul:
    """y[M, N] = x[M, K] @ w[N, K]^T."""

    @staticmethod
    def execute[wdt: DType, target: StaticString](
        y: OutputTensor[dtype=DType.float32, rank=2, static_spec=_],
        x: InputTensor[dtype=DType.float32, rank=2, static_spec=_],
        w: InputTensor[dtype=wdt, rank=2, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var xp = rebind[F32Ptr](x.unsafe_ptr())
        # No bias: the kernel never reads `b` when has_bias is False.
        _run[wdt](
            rebind[F32Ptr](y.unsafe_ptr()), xp, rebind[WPtr[wdt]](w.unsafe_ptr()),
            xp, x.dim_size(0), x.dim_size(1), w.dim_size(0), False, ctx,
        )


def _run_packed[fmt: Int, dot: Int](
    y: F32Ptr, x: F32Ptr, w: U8Ptr, b: F32Ptr,
    M: Int, K: Int, N: Int, row_bytes: Int, has_bias: Bool,
) raises:
    if K % block_elems[fmt]() or row_bytes != K // block_elems[fmt]() * block_bytes[fmt]():
        raise Error(
            "packed weight rows of ", row_bytes, " bytes do not hold K=", K,
            " values of GGML type ", fmt,
        )
    var cpu = Optional[CpuCtx](None)
    packed_matmul[fmt, dot](x, w, b, y, M, K, N, has_bias, max(1, parallelism_level(cpu)), cpu)


@extensibility.register("gpt2_packed_linear")
struct PackedLinear:
    """y[M, N] = x[M, K] @ dequant(w)[N, K]^T + b[N], `w` GGUF blocks of GGML type
    `fmt` as the file stores them (see `kquant.mojo`)."""

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
