"""rpeg_jax.models"""
