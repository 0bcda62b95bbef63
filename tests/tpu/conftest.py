"""The tpu tier (issue 24): k3's tpu platform through torch-xla on PJRT's CPU device.

Collected only by `.ci/tpu.sh` (`pytest tests/tpu --confcutdir=tests/tpu` in the torch 2.9 +
torch-xla venv): tests/conftest.py ignores this directory, and every test here is skipped, with
the reason, where torch_xla does not import.
"""

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

try:
    import torch_xla  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no XLA here
    XLA_MISSING = f"torch_xla is not importable ({type(e).__name__}: {e}); run .ci/tpu.sh"
else:
    XLA_MISSING = ""


def pytest_collection_modifyitems(config, items):
    if XLA_MISSING:
        skip = pytest.mark.skip(reason=XLA_MISSING)
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def xla_device():
    import torch_xla

    return torch_xla.device()


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A random k3-tiny checkpoint, written once per session and only read by the tests."""
    from k3.cli.checkpoint import init_checkpoint

    return init_checkpoint("k3-tiny", tmp_path_factory.mktemp("tpu") / "k3-tiny", progress=False)


@pytest.fixture(scope="session")
def xla_compiles():
    """() -> the XLA compilations so far (torch-xla's `CompileTime` metric: one sample each)."""
    import torch_xla.debug.metrics as met

    return lambda: int((met.metric_data("CompileTime") or (0,))[0])
