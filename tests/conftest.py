"""Shared test set-up: GPU tests skip, with the reason, where there is no driver or no GPU."""
from __future__ import annotations

import pytest


def _gpu_skip_reason() -> str | None:
    from lucegen.runtime import driver
    try:
        driver.init()
        return None
    except driver.NoDriverError as e:
        return f"no usable NVIDIA GPU: {e}"


def pytest_collection_modifyitems(config, items):
    gpu_items = [i for i in items if "gpu" in i.keywords]
    if not gpu_items:
        return
    reason = _gpu_skip_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
