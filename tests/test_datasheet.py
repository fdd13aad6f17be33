"""The datasheet lookup MFU and bandwidth shares are reported against: NVIDIA's dense figures (half the sparse ones
the datasheets lead with), by the name CUDA gives each card; parts not tabulated give None."""

import pytest

from benchmarks import datasheet

CASES = [
    # CUDA device name, (dense bf16 TFLOP/s, dense TF32 TFLOP/s, HBM GB/s) or None
    ("NVIDIA H100 80GB HBM3", (989.4, 494.7, 3350.0)),
    ("NVIDIA H100 PCIe", (756.0, 378.0, 2000.0)),
    ("NVIDIA H200", (989.4, 494.7, 4800.0)),
    ("NVIDIA A100-SXM4-80GB", (312.0, 156.0, None)),
    ("NVIDIA A100 80GB PCIe", (312.0, 156.0, None)),
    ("NVIDIA L40S", (362.05, 183.0, 864.0)),
    ("NVIDIA H100 NVL", None),
    ("NVIDIA GeForce RTX 4090", None),
]


@pytest.mark.parametrize(("name", "figures"), CASES)
def test_card_figures_by_device_name(name, figures):
    found = datasheet.card(name)
    assert (found and (found.bf16_tflops, found.tf32_tflops, found.hbm_gb_per_s)) == figures
    assert datasheet.bf16_tflops(name) == (figures[0] if figures else None)


def test_the_first_matching_name_wins():
    """ "H100 PCIe" also contains "H100": the PCIe row is listed first so that it is the one found."""
    assert datasheet.card("NVIDIA H100 PCIe").hbm_gb_per_s == 2000.0
