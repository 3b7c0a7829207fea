"""Shared test fixtures: the device parametrization and deterministic seeding."""

from __future__ import annotations

import pytest
import torch

# Inductor compiles C++ in a pool of worker processes by default. Under two pytest workers
# on two cores the pool only adds its start-up: one thread took about a third less CPU per
# compile of test_compile.py's inductor cases.
torch._inductor.config.compile_threads = 1

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

#: Parametrize a test over every device: ``@pytest.mark.parametrize("device", DEVICES)``.
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each device-dependent test runs on ``cpu`` and, when present, ``cuda``."""
    return request.param


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
