"""bfloat16 both ways distcomm stores it: as ``ml_dtypes.bfloat16`` (when installed) and as uint16 bits."""

from __future__ import annotations

import pytest

from distcomm import arrays

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - the bits path is still tested
    ml_dtypes = None

#: Parameters of a ``bf16_mode`` fixture.
BF16_MODES = ["ml_dtypes", "bits"]


def use_bf16_mode(mode: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Store bfloat16 as ml_dtypes.bfloat16 (skipped without ml_dtypes) or as uint16 ``"bits"``."""
    if mode == "ml_dtypes" and ml_dtypes is None:
        pytest.skip("ml_dtypes is not installed")
    monkeypatch.setattr(arrays, "USE_ML_DTYPES", mode == "ml_dtypes")
    return mode
