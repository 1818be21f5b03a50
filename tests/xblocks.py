"""The check of a buffer of XBlocks a kernel wrote (the GPU tests of the kernels that quantize activations)."""
from __future__ import annotations

import numpy as np

from lucegen.kernels import qgemv


def assert_xblocks_of(got: np.ndarray, rows: np.ndarray) -> None:
    """got (a buffer's bytes, every one 0xFF before the kernel ran) holds the XBlocks of rows [m, k] in the GPU's
    layout, bit for bit (qgemv.xblocks at qgemv.xblock_index), and no other byte was written."""
    m, k = rows.shape
    np.testing.assert_array_equal(qgemv.xblocks_of(got, m, k), qgemv.xblocks(rows))
    rest = got.copy()
    qgemv.place_xblocks(rest, np.full((m, k // 32 * qgemv.XBLOCK_BYTES), 0xFF, np.uint8))
    assert (rest == 0xFF).all(), "XBlocks written outside the rows' places"
