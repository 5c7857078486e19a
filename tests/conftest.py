"""Test setup: 8 CPU devices for mesh tests (set before JAX is imported), markers, helpers."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_ENABLE_X64", "0")
# A persistent XLA cache private to this run (tests compile the same small programs many times, and
# compilation dominates their time on 2 cores). It is never shared with another run or checkout: JAX
# writes entries in place (no rename), and an entry written by another run's killed or differently
# configured process once crashed the reader inside deserialize_executable (CI, session 20). The
# pytest process keeps its own subfolder; subprocesses inherit `children/` (and the local multi-process
# launcher gives each process topology its own folder below that).
_XLA_CACHE = tempfile.mkdtemp(prefix="rpeg_jax_test_xla_cache_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_XLA_CACHE, "children")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Hermetic: no calibrated hardware profile of the user's (~/.cache/rpeg_jax) is ever read or written;
# a test that wants one sets RPEG_CACHE itself.
os.environ["RPEG_CACHE"] = tempfile.mkdtemp(prefix="rpeg_jax_test_cache_")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.path.join(_XLA_CACHE, "main"))


def pytest_unconfigure(config):
    shutil.rmtree(os.environ["RPEG_CACHE"], ignore_errors=True)
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs a GPU (jax.devices() has none)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. Every XLA:CPU executable keeps its own
    memory mappings alive; one pytest process running the whole default suite serially (CI) reached
    the kernel's vm.max_map_count (65530) near its end and segfaulted inside XLA (compile in CI on
    session 21's tree, deserialize_executable on session 20's). Measured on three sampler modules:
    6355 mappings without this, 626 with it, and no slower (the persistent cache refills)."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture
def cpu_devices():
    devs = jax.devices("cpu")
    assert len(devs) >= 8, "conftest should have forced 8 CPU devices"
    return devs
