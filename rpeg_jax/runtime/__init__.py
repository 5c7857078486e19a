"""rpeg_jax.runtime"""
