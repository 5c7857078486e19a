"""rpeg_jax.runtime: runs the compiled RPEG step after step (see runtime/trainer.py).

from rpeg_jax.runtime import train
summary = train(load_config("configs/default.yaml"))
"""


def train(cfg, **kw):
    from rpeg_jax.runtime.trainer import train as _train

    return _train(cfg, **kw)


__all__ = ["train"]
