"""rpeg_jax.sampling"""
