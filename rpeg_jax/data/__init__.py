"""rpeg_jax.data"""
