"""bench/ceiling.py prices the same work as bench/generate.py's limits: its decode-step weight
products are the matmul FLOPs of G1's limit, and its K/V bytes the rest of G1's bytes per step."""

import importlib.util
import os
import sys

import pytest

from rpeg_jax.config.model import model_preset

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture(scope="module")
def ceiling():
    sys.path.insert(0, BENCH)
    try:
        spec = importlib.util.spec_from_file_location("bench_ceiling", os.path.join(BENCH, "ceiling.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
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
    assert ceiling.kv_step_bytes(name) == pytest.approx(bytes_step - weights, rel=1e-6)
