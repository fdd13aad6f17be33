"""`infosieve_fast.common.precision`: TF32 switched through one API, so torch's legacy getters never see a mix."""

from __future__ import annotations

import pytest
import torch

from infosieve_fast.common import precision

MATMUL = torch.backends.cuda.matmul


@pytest.fixture
def restore_matmul_state():
    name = "fp32_precision" if precision.has_fp32_precision_api() else "allow_tf32"
    saved = getattr(MATMUL, name)
    yield
    setattr(MATMUL, name, saved)


@pytest.mark.skipif(not precision.has_fp32_precision_api(), reason="torch < 2.9 has only the legacy flag")
def test_the_new_api_is_used_and_the_legacy_state_stays_readable(restore_matmul_state):
    precision.set_cuda_matmul_tf32(True)
    assert MATMUL.fp32_precision == "tf32" and precision.cuda_matmul_tf32_allowed()
    precision.set_cuda_matmul_tf32(False)
    assert MATMUL.fp32_precision == "ieee" and not precision.cuda_matmul_tf32_allowed()
    # then what kmeans._cuda_matmul_precision does around its GEMMs: a new-API switch and back; torch raises
    # "mix of the legacy and new APIs" on these legacy reads when the flag was set through `allow_tf32` instead
    MATMUL.fp32_precision = "tf32"
    MATMUL.fp32_precision = "ieee"
    assert MATMUL.allow_tf32 is False and torch.get_float32_matmul_precision() == "highest"


def test_without_the_new_api_the_legacy_flag_is_used(monkeypatch, restore_matmul_state):
    monkeypatch.setattr(precision, "has_fp32_precision_api", lambda: False)
    precision.set_cuda_matmul_tf32(True)
    assert MATMUL.allow_tf32 is True and precision.cuda_matmul_tf32_allowed()
    precision.set_cuda_matmul_tf32(False)
    assert MATMUL.allow_tf32 is False and not precision.cuda_matmul_tf32_allowed()
