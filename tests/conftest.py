"""Test setup: 8 CPU devices for mesh tests (set before JAX is imported), markers, helpers."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_ENABLE_X64", "0")
# One persistent XLA cache for the whole run (subprocesses inherit it): tests compile the same
# small programs many times, and compilation dominates their time on 2 cores.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rpeg_jax_test_xla_cache_{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Hermetic: no calibrated hardware profile of the user's (~/.cache/rpeg_jax) is ever read or written;
# a test that wants one sets RPEG_CACHE itself.
os.environ["RPEG_CACHE"] = tempfile.mkdtemp(prefix="rpeg_jax_test_cache_")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_unconfigure(config):
    shutil.rmtree(os.environ["RPEG_CACHE"], ignore_errors=True)


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
