"""How reference results are compared: relative error, never on zeros, NaN never passes."""
from __future__ import annotations

import numpy as np


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out is not finite. ref must be finite and nonzero."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: {out.shape} vs reference {ref.shape}")
    ref_norm = np.linalg.norm(ref)
    if not np.isfinite(ref_norm) or ref_norm == 0:
        raise ValueError("the reference is zero or not finite: a relative error means nothing")
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / ref_norm)
