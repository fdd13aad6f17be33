"""GCD methods on the shared engine, one module each: its heads, its loss, how it labels the train set (`base`).

`METHODS` maps the config's `method:` value to the class; InfoSieve's own loss stays `infosieve_fast.network.loss`
(`infosieve.py` adapts it to the interface).
"""

from .base import LABELS, MODEL_OUTPUT, PREDICTIONS, Method, StepTensors
from .gcd import GCD
from .infosieve import InfoSieve
from .selex import SelEx
from .simgcd import SimGCD

METHODS: dict[str, type[Method]] = {m.name: m for m in (InfoSieve, GCD, SimGCD, SelEx)}

__all__ = [
    "LABELS",
    "METHODS",
    "MODEL_OUTPUT",
    "PREDICTIONS",
    "GCD",
    "InfoSieve",
    "Method",
    "SelEx",
    "SimGCD",
    "StepTensors",
]
