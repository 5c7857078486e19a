"""bench/train_mfu.py: its FLOP count (the cost model's) equals one counted from the model's own
weight shapes, and its --dry-run runs one update and writes a finite record."""

import json
import os

import jax
import pytest
from flax import nnx
from helpers import load_file

from rpeg_jax.config.model import model_preset
from rpeg_jax.costmodel.shape import ModelShape
from rpeg_jax.graph.algorithms import model_dims
from rpeg_jax.models import Transformer

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture(scope="module")
def tm():
    return load_file("bench_train_mfu", os.path.join(BENCH, "train_mfu.py"))


def hand_flops(model, b: int, s: int, r: int) -> float:
    """3 x forward, counted from the parameter tree: 2 FLOPs per multiply-add of every layer weight
    matrix (w* leaves, biases and norms excluded) per token, of the LM head (or tied embedding) per
    scored token, and causal attention: q.k and p.v are 2·s²·H·E FLOPs each per layer dense, half
    of that under the causal mask."""
    cfg = model.cfg
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    named = {jax.tree_util.keystr(p): v for p, v in leaves}
    layer_w = sum(v.size for k, v in named.items() if "['layers']" in k and "['w" in k)
    head = named["['embed'].value"] if cfg.tie_embeddings else named["['lm_head'].value"]
    attn = cfg.num_layers * 0.5 * (2 + 2) * s * s * cfg.num_heads * cfg.head_size
    return 3.0 * (2.0 * b * s * layer_w + 2.0 * b * r * head.size + b * attn)


@pytest.mark.parametrize(
    "kw",
    [
        {},  # tiny: untied head, H=4, K=2
        dict(qkv_bias=True, tie_embeddings=True, head_dim=48, num_kv_heads=1, num_layers=5),
    ],
)
def test_flops_equal_a_count_from_the_weight_shapes(tm, kw):
    cfg = model_preset("tiny", **kw)
    model = Transformer(cfg, rngs=nnx.Rngs(params=0))
    ms = ModelShape.of(model_dims(cfg, "actor"))
    b, s, r = 3, 40, 25
    assert tm.model_flops(ms, b, s, r) == pytest.approx(hand_flops(model, b, s, r), rel=1e-12)


def test_executed_flops_add_the_masked_half_for_dense_attention(tm):
    """xla (dense) attention computes the masked half too: executed - model = 2·L·H·E·B·S² x 3."""
    cfg = model_preset("tiny", dtype="bfloat16")
    ms = ModelShape.of(model_dims(cfg, "actor"))
    b, p, r = 2, 16, 48
    hw = tm.load_hardware("cpu", calibrated=False)
    dense = tm.stage_prediction(hw, ms, b, p, r, "xla", "dots", 1)["executed_flops"]
    flash = tm.stage_prediction(hw, ms, b, p, r, "cudnn", "dots", 1)["executed_flops"]
    s = p + r
    assert flash == pytest.approx(tm.model_flops(ms, b, s, r), rel=1e-12)
    assert dense - flash == pytest.approx(3 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_size * b * s * s, rel=1e-9)


# 21 s; the FLOP count is checked by default (test_flops_equal_...) (slow: session 24's trim of the default run)
@pytest.mark.slow
def test_dry_run_writes_a_finite_record(tm, tmp_path):
    out = tmp_path / "train.json"
    assert tm.main(["--dry-run", "--json", str(out)]) == 0
    (rec,) = json.loads(out.read_text())
    assert rec["finite"] and rec["seconds"] > 0 and rec["batch"] * rec["seq"] == 4 * 64
    assert rec["mfu"] == pytest.approx(rec["model_flops"] / rec["seconds"] / rec["peak_flops"])
    assert rec["dtype"] == "bfloat16" and rec["param_dtype"] == "float32"


def test_bad_flags_name_the_flag(tm):
    with pytest.raises(SystemExit, match="--response=64"):
        tm.main(["--dry-run", "--response", "64"])
