"""Test setup: 8 CPU devices for mesh tests (set before JAX is imported), markers, helpers."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_ENABLE_X64", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs a GPU (jax.devices() has none)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture
def cpu_devices():
    devs = jax.devices("cpu")
    assert len(devs) >= 8, "conftest should have forced 8 CPU devices"
    return devs
