"""Lets a checkpoint's file go once the model holds its own copy of every weight.

MAX reads a CPU weight in place for the model's lifetime, so both adapters copy
every tensor out of the file (into huge pages, `hugepages.py`); after compiling,
nothing the model reads lies in the file, and its pages, all touched at load,
would otherwise stay resident beside the copies.
"""

from __future__ import annotations

import ctypes
import mmap

from max.graph.weights import GGUFWeights, SafetensorWeights, Weights

from ..shims.internals import gguf_reader


def release(weights: Weights) -> None:
    """Closes the checkpoint's file mapping, or drops its pages where MAX gives no close."""
    # `getattr` would not do: `Weights` answer any attribute with a child.
    if isinstance(weights, SafetensorWeights):
        weights.close()
    elif isinstance(weights, GGUFWeights):
        release_pages(weights)


_libc = ctypes.CDLL(None, use_errno=True)


def release_pages(weights: GGUFWeights) -> None:
    """Returns the file's pages to the kernel once every tensor has been copied out.

    `GGUFWeights` has no `close()`: its reader keeps the whole file mapped for
    the life of the process, and the pages the adapter read stay resident
    beside the copies the model holds (`hugepage_array`). `MADV_DONTNEED` drops
    them from this process; the mapping is a read-only view of the file, so a
    later read would fault them back in from it.
    """
    data = gguf_reader(weights).data
    if data.nbytes:
        address = ctypes.c_void_p(data.ctypes.data)
        if _libc.madvise(address, ctypes.c_size_t(data.nbytes), mmap.MADV_DONTNEED):
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) on the GGUF mapping")
