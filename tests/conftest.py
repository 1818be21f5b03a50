"""Shared test set-up: GPU tests skip, with the reason, where there is no driver or no GPU; the tiny test
checkpoint (random peaked weights of tiny_config(), HF layout with its tokenizer) and a tiny random DFlash draft
for it, made once per session."""
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


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from lucegen.model.checkpoint import make_checkpoint
    from lucegen.model.config import tiny_config
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config(), peaked=True, formats=("hf",),
                           progress=False)["hf"]


@pytest.fixture(scope="session")
def draft(tmp_path_factory):
    from lucegen.model.config import tiny_config
    from lucegen.model.draft import write_draft
    from lucegen.model.draft_config import tiny_draft_config
    from lucegen.reference.dflash import random_draft_weights
    cfg = tiny_draft_config(tiny_config())
    return write_draft(tmp_path_factory.mktemp("draft"), cfg, random_draft_weights(cfg, seed=3))
