"""Quantizes float32 rows into llama.cpp's GGUF block formats.

The `gguf` package quantizes the 32-element formats (Q4_0, Q8_0, ...) but not the
256-element "K" formats, which raise `NotImplementedError` there; those are
written here, byte for byte in ggml's block layout, and the tests read them back
with `gguf`'s own dequantization. The K quantizers are plain min/max rounding
(llama.cpp searches scales iteratively for a little less error): what matters
for serving is the byte layout, which fixes both cost and kernel arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType, quants

QK_K = 256
"""Elements per K-format super-block."""


def _f16(x: np.ndarray) -> np.ndarray:
    """Float16 bytes of `x`, shape `[..., 2]`."""
    return x.astype(np.float16)[..., None].view(np.uint8)


def _safe_div(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d == 0, 0.0, x / np.where(d == 0, 1.0, d))


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's 12-byte packing of eight 6-bit scales and eight 6-bit mins."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    low = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return np.concatenate([low, mid, high], axis=1)


def _affine_k(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K: eight 32-element sub-blocks, `x ≈ d·sc·q − dmin·m`, `q` unsigned."""
    levels = (1 << bits) - 1
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    scale = (sub.max(axis=-1) - lo) / levels
    offset = -lo
    d = (scale.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (offset.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63)
    m = np.clip(np.rint(_safe_div(offset, dmin[:, None])), 0, 63)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(_safe_div(sub + (dmin[:, None] * m)[..., None], step)), 0, levels)
    q = q.astype(np.uint8)
    head = np.concatenate([_f16(d), _f16(dmin), _pack_scale_min(sc, m)], axis=1)
    return head, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Sub-blocks 2c and 2c+1 share 32 bytes: low and high nibble."""
    q = q & 0xF
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(q), -1)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _affine_k(blocks, bits=4)
    return np.concatenate([head, _nibbles(q)], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _affine_k(blocks, bits=5)
    high = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(high, axis=1).astype(np.uint8)
    return np.concatenate([head, qh, _nibbles(q)], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Sixteen 16-element sub-blocks, `x ≈ d·sc·(q − 32)`, int8 `sc`."""
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = (scale.max(axis=-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), -128, 127)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8)
    # Each 128-element half is four 32-element groups g: low nibbles of g0|g2
    # and g1|g3 share bytes, the two high bits of all four share one byte.
    g = q.reshape(-1, 2, 4, 32)
    ql = np.concatenate(
        [(g[:, :, 0] & 0xF) | ((g[:, :, 2] & 0xF) << 4),
         (g[:, :, 1] & 0xF) | ((g[:, :, 3] & 0xF) << 4)],
        axis=2,
    ).reshape(len(q), -1)
    qh = ((g >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None])
    qh = np.bitwise_or.reduce(qh, axis=2).reshape(len(q), -1).astype(np.uint8)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, _f16(d)], axis=1)


K_QUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
}


def quantize(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`array` (float32, rows along the last axis) as GGUF bytes of type `qtype`.

    Returns a uint8 array `[..., row_bytes]`, the shape `GGUFWriter` expects
    for quantized tensors.
    """
    if qtype == GGMLQuantizationType.F32:
        return array.astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return array.astype(np.float16)
    if qtype not in K_QUANTIZERS:
        return quants.quantize(array.astype(np.float32), qtype)
    rows = array.reshape(-1, array.shape[-1]).astype(np.float32)
    if rows.shape[-1] % QK_K:
        raise ValueError(
            f"{qtype.name} needs rows of a multiple of {QK_K} values; got {rows.shape[-1]}."
        )
    packed = K_QUANTIZERS[qtype](rows.reshape(-1, QK_K))
    return packed.reshape(*array.shape[:-1], -1)
