"""Weight arrays backed by transparent huge pages.

A decode step streams every weight from memory once per token, so what bounds it is how
fast the cores can stream. With 4 KiB pages each weight stream crosses a page boundary
every 4 KiB: a TLB miss and a restart of the hardware prefetcher each time. On CPU, MAX
runs the compiled model on the weight arrays the adapters hand it, without copying them,
so the adapters place every large weight in memory that asked the kernel for 2 MiB pages
(`madvise(MADV_HUGEPAGE)`, honoured when transparent huge pages are `madvise` or
`always`, the Linux defaults). Where the platform has no such advice the copy is an
ordinary array, and only the speed differs.

Copying also detaches the weights from the checkpoint file: nothing keeps the file's
memory map, and its pages, alive once the model is built.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20
"""The x86-64 and arm64 transparent huge page size."""


def hugepage_array(array: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `array`, in huge-page-advised memory when it spans one."""
    if array.nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.array(array, order="C", copy=True)
    # One extra page of room so the data can start on a huge-page boundary: the kernel
    # only maps aligned 2 MiB ranges with huge pages.
    length = -(-array.nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    start = np.frombuffer(region, dtype=np.uint8).ctypes.data
    offset = -start % HUGE_PAGE
    out = np.frombuffer(region, dtype=array.dtype, count=array.size, offset=offset)
    out = out.reshape(array.shape)
    out[...] = array
    return out
