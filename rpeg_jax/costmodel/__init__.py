"""rpeg_jax.costmodel"""
