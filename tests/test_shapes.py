"""The shapes floor (rpeg_jax/shapes/): its rules against brute-force references, and the guard that
each rule is defined once in the tree (the program and the cost model import it, nobody copies it)."""

import ast
import os

import numpy as np
import pytest

from rpeg_jax.shapes import admission as policy
from rpeg_jax.shapes.buckets import LENGTH_BUCKET, TableWidths, length_bucket, pow2ceil, width_bucket
from rpeg_jax.shapes.flops import Dims, attention_pairs
from rpeg_jax.shapes.logits import LOGITS_BUDGET, chunk_elements, logits_chunk
from rpeg_jax.shapes.packing import first_fit_decreasing, packed_shape, row_quantum, token_quantum

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pow2ceil_and_width_buckets():
    assert [pow2ceil(n) for n in (0, 1, 2, 3, 4, 5, 17)] == [1, 1, 2, 4, 4, 8, 32]
    for lo, growth in ((1, 2.0), (3, 1.25), (16, 2.0)):
        seq = [lo]
        while seq[-1] < 400:
            seq.append(max(seq[-1] + 1, int(np.ceil(seq[-1] * growth))))
        for need in range(0, 300):
            assert width_bucket(need, lo, growth) == min(w for w in seq if w >= need)


def test_length_bucket():
    assert [length_bucket(n) for n in (1, 8, 9, 16, 17)] == [LENGTH_BUCKET, 8, 16, 16, 24]
    assert length_bucket(13, fixed=50) == 50


def test_table_widths_align_equals_a_search_over_widths():
    """The closed-form chunk cut equals the sampler's former search: the largest k' in [lo, k] whose
    width is still that of lo = min(k, min_steps)."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        page, growth = int(rng.integers(1, 6)), float(rng.choice([1.25, 1.5, 2.0]))
        prompt, max_new = int(rng.integers(1, 9)), int(rng.integers(2, 40))
        tw = TableWidths(page, -(-(prompt + max_new) // page), int(rng.integers(1, 4)), growth)
        n = int(rng.integers(1, 6))
        made = rng.integers(0, max_new, size=n)
        end = prompt + np.maximum(made + 1, rng.integers(1, max_new + 1, size=n))
        pos = prompt - 1 + made
        k, lo = int(rng.integers(1, 30)), int(rng.integers(1, 10))
        want = k
        if k > min(k, lo):
            w = tw.pages(pos, end, min(k, lo))
            want = max(j for j in range(min(k, lo), k + 1) if tw.pages(pos, end, j) <= w)
        assert tw.align(pos, end, k, lo) == want
        # pages: the bucket of the pages that hold min(pos + k, end - 1) tokens
        need = int(np.max(np.minimum(pos + k, end - 1)))
        assert tw.pages(pos, end, k) == min(width_bucket(-(-need // page), tw.buckets[0], growth), tw.max_pages)


def test_chunk_length_is_the_engines_early_exit():
    """shapes/admission.chunk_length against the device loop's rule step by step: after each step
    the chunk ends once `n` slots have freed and at least `min_steps` steps ran, or at k."""
    rng = np.random.default_rng(1)
    for _ in range(500):
        rem = rng.integers(1, 20, size=int(rng.integers(1, 8)))
        k, min_steps, n = int(rng.integers(1, 25)), int(rng.integers(0, 6)), int(rng.integers(1, 10))
        steps = 0
        while steps < k:
            steps += 1
            if steps >= min_steps and int((rem <= steps).sum()) >= n:
                break
        assert policy.chunk_length(rem, k, (min_steps, n)) == steps
    assert policy.release_rule(True, [3, 2], 4, 8) == (4, 3)
    assert policy.release_rule(True, [], 4, 8) == (0, 9) == policy.release_rule(False, [3], 4, 8)


def test_packing_quanta_and_ffd():
    assert row_quantum(64, 1) == 4 and row_quantum(64, 3) == 6 and token_quantum(64, 10) == 80
    assert packed_shape(5, 81, 64, 10, 1) == (8, 160) and packed_shape(0, 0, 64, 10) == (4, 80)
    bins = first_fit_decreasing([5, 3, 0, 4, 2, 6], 8)
    assert bins == [[5, 4], [0, 1], [3]]  # 6+2, 5+3, 4 (the zero-length item is left out)


def test_logits_chunk_stays_in_the_budget():
    for rows, vocab in ((1, 152064), (16, 49152), (128, 32000)):
        c = logits_chunk(rows, 4096, vocab)
        assert rows * c * vocab <= LOGITS_BUDGET < rows * (c + 1) * vocab
    assert logits_chunk(256, 10, 152064) == 1  # rows x vocab alone above the budget: one position
    assert chunk_elements(np.array([0.0, 10.0]), 1000).tolist() == [0.0, 10000.0]


def test_flops_count_every_matmul_of_a_layer():
    d = Dims(L=2, D=64, H=4, K=2, E=16, F=128, V=100)
    per_layer = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)  # q, k, v, o, gate, up, down
    assert d.layer_matmul_flops == per_layer and d.head_flops == 2 * 64 * 100
    # a causal pass over one sequence of s tokens: s²/2 pairs of 4·H·E FLOPs per layer
    s = 10
    got = d.forward(s, s, attention_pairs(s * s, causal=True))
    assert got == pytest.approx(s * 2 * per_layer + s * 2 * 64 * 100 + 2 * 4 * 4 * 16 * s * s / 2)


# The floor's names: each may be defined (assigned at module level, or a def / class) only in
# rpeg_jax/shapes/. A copy elsewhere, however named, is what issue 30 removed; these are the names.
FLOOR_NAMES = {
    "LOGITS_BUDGET",
    "LENGTH_BUCKET",
    "RUNTIME_LENGTH_BUCKET",
    "ROW_BUCKETS",
    "TOKEN_BUCKETS",
    "PACK_ROW_BUCKETS",
    "PACK_TOKEN_BUCKETS",
    "MIN_TABLE_WIDTH",
    "SAMPLER_MIN_TABLE_WIDTH",
    "TableWidths",
    "width_bucket",
    "pow2ceil",
    "first_fit_decreasing",
    "ffd_bins",
    "row_quantum",
    "token_quantum",
    "length_bucket",
    "release_rule",
    "chunk_length",
    "fresh_enough",
    "wants_group",
    "Dims",
    "_matmul_weights",
    "prompt_groups_fit",
}


def test_each_floor_rule_is_defined_once():
    where: dict[str, list[str]] = {}
    for top in ("rpeg_jax", "bench", "launch"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.relpath(os.path.join(dirpath, f), ROOT)
                tree = ast.parse(open(os.path.join(ROOT, path)).read())
                for node in tree.body:
                    names = []
                    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                        names = [node.name]
                    elif isinstance(node, ast.Assign):
                        names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                        names = [node.target.id]
                    for n in names:
                        if n in FLOOR_NAMES:
                            where.setdefault(n, []).append(path)
    outside = {n: p for n, p in where.items() if any(not x.startswith(os.path.join("rpeg_jax", "shapes")) for x in p)}
    assert not outside, f"floor rules defined outside rpeg_jax/shapes/: {outside}"
    assert all(len(p) == 1 for p in where.values()), where
