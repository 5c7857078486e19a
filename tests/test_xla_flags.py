"""rpeg_jax.runtime.xla_flags: the opt-in per-program options (YNNPACK off on CPU), never over XLA_FLAGS."""

import os

import jax
import jax.numpy as jnp
import pytest

from rpeg_jax.runtime import xla_flags

YNN = "xla_cpu_experimental_ynn_fusion_type"


def test_opt_in_only_and_xla_flags_win():
    assert xla_flags.train_compiler_options({}) == {}  # default: XLA's own defaults
    assert xla_flags.train_compiler_options({"RPEG_TRAIN_NO_YNN": "0"}) == {}
    assert xla_flags.train_compiler_options({"RPEG_TRAIN_NO_YNN": "1"}) == {YNN: ""}  # tests run on CPU
    env = {"RPEG_TRAIN_NO_YNN": "1", "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 --{YNN}=dot"}
    assert xla_flags.train_compiler_options(env) == {}


def test_options_compile_without_ynn_and_agree():
    """The option removes the YNNPACK fusion that the default compile has (the positive control:
    were YNNPACK gone from XLA's CPU defaults, its absence with the option would prove nothing)."""
    if jax.default_backend() != "cpu":
        pytest.skip(f"YNNPACK is XLA:CPU's; the default backend is {jax.default_backend()}")
    opts = xla_flags.train_compiler_options({"RPEG_TRAIN_NO_YNN": "1"})
    assert opts == {YNN: ""}
    a = jax.random.normal(jax.random.key(0), (256, 64))
    b = jax.random.normal(jax.random.key(1), (64, 96))
    f = lambda a, b: jax.nn.silu(a @ b)  # noqa: E731
    try:
        off = jax.jit(f, compiler_options=opts).lower(a, b).compile()
    except Exception as e:  # XlaRuntimeError: INVALID_ARGUMENT: No such compile option
        if "No such compile option" not in str(e):
            raise
        pytest.skip(f"this JAX ({jax.__version__}) has no {YNN} option: no YNNPACK to turn off")
    default = jax.jit(f).lower(a, b).compile()
    assert "ynn_fusion" in default.as_text(), (
        f"the default CPU compile has no YNNPACK fusion (JAX {jax.__version__}, XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '')!r}): RPEG_TRAIN_NO_YNN would be a no-op; revisit runtime/xla_flags.py"
    )
    assert "ynn_fusion" not in off.as_text()
    assert jnp.allclose(off(a, b), default(a, b), rtol=1e-5, atol=1e-5)  # float32 rounding apart
