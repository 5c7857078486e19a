"""bench/ceiling.py prices the same work as bench/generate.py's limits: its decode-step weight
products are the matmul FLOPs of G1's limit, and its K/V bytes the rest of G1's bytes per step."""

import os
import sys

import pytest
from helpers import load_file

from rpeg_jax.config.model import model_preset

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture(scope="module")
def ceiling():
    sys.path.insert(0, BENCH)
    try:
        yield load_file("bench_ceiling", os.path.join(BENCH, "ceiling.py"))
    finally:
        sys.path.remove(BENCH)


@pytest.mark.parametrize("name", ["G1-T-greedy", "G1-T-grpo", "G1-S-greedy"])
def test_ceiling_prices_the_work_of_the_g1_limit(ceiling, name):
    G = ceiling.G
    preset, prompts, plen, n, new, _, _ = G.WORKLOADS[name]
    cfg = model_preset(preset)
    ctx = plen + new / 2  # the mean context of generate.py's limit
    flops_tok, bytes_step = G.work_per_token(cfg, prompts * n, ctx, 4)
    attn = cfg.num_layers * 4 * cfg.num_heads * cfg.head_size * ctx
    assert 2 * sum(i * o for i, o in ceiling.weight_shapes(cfg)) == pytest.approx(flops_tok - attn, rel=1e-12)
    weights = (cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_embeddings else 1)) * 4
    kv = prompts * n * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_size * 4  # K and V, float32
    assert ceiling.kv_step_bytes(name) == pytest.approx(kv, rel=1e-6)
    assert bytes_step - weights == pytest.approx(kv, rel=1e-6)


@pytest.mark.parametrize("lc,rc", [(1, 0), (0, 0), (1, 1), (0, 1)])
def test_matrix_layouts_compute_the_same_product_and_name_the_original(ceiling, lc, rc):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    m, k, n = 5, 3, 4
    a = jnp.asarray(rng.standard_normal((m, k) if lc == 1 else (k, m)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((k, n) if rc == 0 else (n, k)), jnp.float32)
    dn = (((lc,), (rc,)), ((), ()))
    ref = np.asarray(a, np.float64)
    ref = (ref if lc == 1 else ref.T) @ (np.asarray(b, np.float64) if rc == 0 else np.asarray(b, np.float64).T)
    layouts, own = ceiling._matrix_layouts(a, b, dn)
    assert len(layouts) == 4
    for aa, bb, d in layouts:
        np.testing.assert_allclose(jax.lax.dot_general(aa, bb, d), ref, rtol=1e-5, atol=1e-5)
    aa, bb, d = layouts[own]  # the product as the program stores it: the one timed as "its own"
    assert d == dn and np.array_equal(aa, a) and np.array_equal(bb, b)


@pytest.mark.parametrize("kind", ["forward", "input_grad", "weight_grad"])
def test_consistent_layouts_store_activations_one_way_per_mode(ceiling, kind):
    """Each option computes the product (or its transpose, when flagged), and in every option of a
    mode each token-row operand and result is stored as the mode says: rows first (token-major) or
    rows last (feature-major). Weights and weight gradients get both orientations."""
    import jax
    import numpy as np

    rng = np.random.default_rng(1)
    rows, i, o = 12, 5, 3
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((rows, i), (i, o), (rows, o)))
    a, b, dn = {
        "forward": (x, w, (((1,), (0,)), ((), ()))),  # y = x W
        "input_grad": (dy, w, (((1,), (1,)), ((), ()))),  # dx = dy W^T
        "weight_grad": (x, dy, (((0,), (0,)), ((), ()))),
    }[kind]  # dW = x^T dy
    ref = np.asarray(jax.lax.dot_general(np.float64(a), np.float64(b), dn))
    modes = ceiling.consistent_layouts(a, b, dn, max(i, o) + 1)  # token rows: longer than any weight axis
    assert set(modes) == {"token-major", "feature-major"}
    for mode, opts in modes.items():
        assert opts
        rows_axis = 0 if mode == "token-major" else 1
        for lhs, rhs, d, transposed in opts:
            got = np.asarray(jax.lax.dot_general(lhs, rhs, d))
            np.testing.assert_allclose(got.T if transposed else got, ref, rtol=1e-5, atol=1e-5)
            for arr in (lhs, rhs, got):
                if rows in arr.shape:
                    assert arr.shape[rows_axis] == rows, (mode, kind, arr.shape)
        weight_outputs = {t for *_, t in opts}
        assert weight_outputs == ({False, True} if kind == "weight_grad" else {rows_axis == 1}), (mode, kind)
    # the weight gradient contracts the rows of both operands token-major, their minor axes feature-major
    if kind == "weight_grad":
        assert all(d[0] == ((0,), (0,)) for *_, d, _ in modes["token-major"])
        assert all(d[0] == ((1,), (1,)) for *_, d, _ in modes["feature-major"])


def test_consistent_layouts_refuse_an_ambiguous_token_axis(ceiling):
    import numpy as np

    x = np.ones((12, 12), np.float32)  # both axes as long as the token rows: which is which?
    with pytest.raises(ValueError, match="ambiguous"):
        ceiling.consistent_layouts(x, np.ones((12, 3), np.float32), (((1,), (0,)), ((), ())), 6)
