"""Without a driver the runtime says so clearly instead of failing obscurely."""
from __future__ import annotations

import pytest

from lucegen.runtime import NoDriverError, gpu_available
from lucegen.runtime.driver import init


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: this checks the no-driver path")
def test_no_driver_is_a_clear_error():
    with pytest.raises(NoDriverError, match="no NVIDIA driver|sees no GPU|unusable"):
        init()
