"""The datasheet figures of NVIDIA cards, looked up by the name CUDA gives the device: what MFU and bandwidth shares
are reported against. Dense figures (half of the sparse ones the datasheets lead with); None where a part is not
tabulated or a figure differs between variants that share a name."""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = "NVIDIA datasheet, dense, no sparsity"


@dataclass(frozen=True)
class Card:
    bf16_tflops: float  # dense bf16 tensor-core peak
    tf32_tflops: float  # dense TF32 tensor-core peak: fp32 matmuls with TF32 allowed, and Triton's tl.dot on fp32
    hbm_gb_per_s: float | None  # memory bandwidth, 10^9 bytes/s


# By a case-insensitive substring of the CUDA device name; the first match wins.
CARDS: tuple[tuple[str, Card | None], ...] = (
    ("NVL", None),  # H100 NVL / H200 NVL: other clocks and power than the SXM parts, not tabulated here
    ("H100 PCIe", Card(756.0, 378.0, 2000.0)),
    ("H100", Card(989.4, 494.7, 3350.0)),  # H100 SXM5, named "NVIDIA H100 80GB HBM3" by CUDA
    ("H200", Card(989.4, 494.7, 4800.0)),
    ("A100", Card(312.0, 156.0, None)),  # 40 GB and 80 GB parts differ in bandwidth
    ("L40S", Card(362.05, 183.0, 864.0)),
)


def card(name: str) -> Card | None:
    """The datasheet figures of the device called `name`, or None."""
    return next((found for key, found in CARDS if key.lower() in name.lower()), None)


def bf16_tflops(name: str) -> float | None:
    found = card(name)
    return found.bf16_tflops if found else None
