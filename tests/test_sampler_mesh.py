"""The sampler on a 2x2 (data, tensor) mesh of CPU devices, with parameters sharded the way the
sharding rules lay them out (heads, kv heads and mlp over `tensor`), on Auto and Explicit meshes:
outputs equal the single-device run (tokens exact, logprobs within 1e-5), the KV pools put kv heads
over `tensor`, and a weight update with the other mesh's parameters does not recompile."""

import os

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import shard
from jax.sharding import AxisType

from rpeg_jax.models import load_hf
from rpeg_jax.sampling import Sampler, SamplerConfig, SamplingParams
from rpeg_jax.sampling.sampler import _COMPILES

HF = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
FIXED = dict(max_seq_len=32, min_prefill_len=32, min_prefill_rows=8, min_table_width=16)
BASE = SamplerConfig(page_size=4, max_slots=8, chunk_steps=8, **FIXED)


def test_sharded_sampler_equals_single_device():
    model = load_hf(os.path.join(HF, "llama_tiny"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (5, 2, 9)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1)
    ref = Sampler(model, BASE).generate(prompts, params)
    devices = jax.devices()[:4]
    meshes = [
        jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(t, t), devices=devices)
        for t in (AxisType.Auto, AxisType.Explicit)
    ]
    samplers = []
    for mesh in meshes:
        sampler = Sampler(shard(model, mesh), BASE)  # the mesh is taken from the parameters
        outs = sampler.generate(prompts, params)
        for o, r in zip(outs, ref):
            for c, d in zip(o.completions, r.completions):
                assert c.tokens.tolist() == d.tokens.tolist()
                np.testing.assert_allclose(c.logprobs, d.logprobs, atol=1e-5)
        assert tuple(sampler.pools[0].sharding.spec)[:2] == (None, "tensor")  # kv heads of [L, K, P, S, E]
        samplers.append(sampler)
    before = _COMPILES.count
    samplers[0].update_weights(nnx.split(shard(model, meshes[1]), nnx.Param)[1])
    samplers[0].generate(prompts, params)
    assert _COMPILES.count == before
    with pytest.raises(ValueError, match="sharding"):
        samplers[0].update_weights(nnx.split(model, nnx.Param)[1])  # single-device weights
