"""rpeg_jax.sharding"""
