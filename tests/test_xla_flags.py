"""rpeg_jax.runtime.xla_flags: the opt-in per-program options (YNNPACK off on CPU), never over XLA_FLAGS."""
import jax
import jax.numpy as jnp

from rpeg_jax.runtime import xla_flags

YNN = "xla_cpu_experimental_ynn_fusion_type"


def test_opt_in_only_and_xla_flags_win():
    assert xla_flags.train_compiler_options({}) == {}  # default: XLA's own defaults
    assert xla_flags.train_compiler_options({"RPEG_TRAIN_NO_YNN": "0"}) == {}
    assert xla_flags.train_compiler_options({"RPEG_TRAIN_NO_YNN": "1"}) == {YNN: ""}  # tests run on CPU
    env = {"RPEG_TRAIN_NO_YNN": "1", "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 --{YNN}=dot"}
    assert xla_flags.train_compiler_options(env) == {}


def test_options_compile_without_ynn_and_agree():
    opts = xla_flags.train_compiler_options({"RPEG_TRAIN_NO_YNN": "1"})
    a = jax.random.normal(jax.random.key(0), (256, 64))
    b = jax.random.normal(jax.random.key(1), (64, 96))
    f = lambda a, b: jax.nn.silu(a @ b)  # noqa: E731
    off = jax.jit(f, compiler_options=opts).lower(a, b).compile()
    assert "ynn_fusion" not in off.as_text()
    assert jnp.allclose(off(a, b), jax.jit(f)(a, b), rtol=1e-5, atol=1e-5)  # float32 rounding apart
