"""rpeg_jax.rl"""
