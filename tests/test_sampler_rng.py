"""The sampler's Gumbel noise source (rpeg_jax/sampling/transforms.py): Threefry-2x32 against the
Random123 known-answer vectors (an independent reference), and the uniforms it yields are in (0, 1)
and roughly uniform. The end-to-end check that sampled tokens follow the intended distribution is
tests/test_sampling_transforms.py (empirical frequencies against a float64 reference)."""

import jax.numpy as jnp
import numpy as np
import pytest

from rpeg_jax.sampling.transforms import _threefry2x32, _threefry_uniform

# Random123 kat_vectors, threefry2x32_20: (key, counter, expected output)
KAT = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("key,ctr,expect", KAT)
def test_threefry2x32_known_answers(key, ctr, expect):
    u = lambda x: jnp.asarray([x], jnp.uint32)  # noqa: E731
    out = _threefry2x32(u(key[0]), u(key[1]), u(ctr[0]), u(ctr[1]))
    assert [int(o[0]) for o in out] == list(expect)


def test_uniforms_in_open_interval_and_uniform():
    keys = np.array([[0, 1], [7, 3], [0xFFFFFFFF, 5]], np.uint32)
    u = np.asarray(_threefry_uniform(jnp.asarray(keys), 30001))  # odd width: the last pair is cut
    assert u.shape == (3, 30001) and (u > 0).all() and (u < 1).all()
    for row in u:  # 10 bins of ~3000: |count - 3000| < 5 sigma (~55 * 5)
        counts = np.bincount((row * 10).astype(int), minlength=10)
        np.testing.assert_allclose(counts, len(row) / 10, atol=5 * np.sqrt(len(row) * 0.09))
    assert not np.array_equal(u[0], u[1])  # different keys, different streams
