"""`hugepage_array`: an exact, contiguous, detached copy; huge-page aligned when large."""

import mmap

import numpy as np
import pytest

from gpt2_max.weights.hugepages import HUGE_PAGE, hugepage_array

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("shape", [(3, 5), (1024, 769), (768, 3 * 768)])
def test_copy_is_exact_contiguous_and_detached(shape):
    source = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    for view in (source, source.T):
        copy = hugepage_array(view)
        assert copy.flags.c_contiguous and copy.flags.writeable
        assert copy.shape == view.shape and copy.dtype == view.dtype
        np.testing.assert_array_equal(copy, view)
        assert not np.shares_memory(copy, source)


def test_large_arrays_start_on_a_huge_page():
    source = np.arange(HUGE_PAGE // 2 + 7, dtype=np.float16)
    copy = hugepage_array(source)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert copy.ctypes.data % HUGE_PAGE == 0
    np.testing.assert_array_equal(copy, source)
