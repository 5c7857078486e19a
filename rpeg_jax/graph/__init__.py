"""rpeg_jax.graph"""
