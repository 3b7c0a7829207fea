"""Shared test fixtures: the device parametrization and deterministic seeding."""

from __future__ import annotations

import pytest
import torch

from mmattn.functional import fused_attn

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


#: The longest file (inductor compiles C++; minutes with a cold cache on 2 cores). ``make
#: test`` runs two xdist workers that take files whole (``--dist loadfile``), handing them
#: out in collection order: it goes first, so that the other files fill in around it instead
#: of one worker ending alone on it.
LONGEST_FILE = "test_compile_inductor.py"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread spares thread start-up and contention (restored
    after the module). Files use it with ``pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fused_only():
    """Pins the fused path on (the engines run on it only). A file that uses it is also
    marked ``pins_path``: the MMATTN_FUSED_ATTN=0 pass of ``make test`` would repeat it
    unchanged."""
    with fused_attn(True):
        yield


def _pins_path(item: pytest.Item) -> bool:
    """A test run for ``fused`` True and False in a module that pins the attention path with
    ``mmattn.functional.fused_attn``: it takes both paths whatever MMATTN_FUSED_ATTN says."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    module = getattr(item, "module", None)
    return "fused" in params and getattr(module, "fused_attn", None) is fused_attn


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``pins_path`` (the second pass of ``make test``, MMATTN_FUSED_ATTN=0, would run
    them again unchanged: it skips them) and put the longest file first."""
    for item in items:
        if _pins_path(item):
            item.add_marker(pytest.mark.pins_path)

    items.sort(key=lambda item: item.path.name != LONGEST_FILE)  # stable: order kept
