"""The typed candidate table (costmodel/table.py): rows taken and concatenated keep every column
aligned (nested continuous-admission columns included), the columns a graph is priced with are the
ones its admission mode names, and the pricing functions take their layouts by keyword only."""

import dataclasses

import numpy as np
import pytest

from rpeg_jax.config import load_config
from rpeg_jax.config.pipeline import PipelineConfig
from rpeg_jax.costmodel import candidates as C
from rpeg_jax.costmodel import context as CX
from rpeg_jax.costmodel import scoring as SC
from rpeg_jax.costmodel import stages as S
from rpeg_jax.costmodel.hardware import load_hardware
from rpeg_jax.costmodel.table import Table
from rpeg_jax.graph.passes import apply_pipeline

GH = load_hardware("gh200", calibrated=False)
WORKLOAD = ["model.preset=qwen2-1.5b", "model.dtype=bfloat16", "data.prompts_per_step=32", "rl.group_size=8"]
WORKLOAD += ["rollout.max_new_tokens=1024", "costmodel.max_staleness=2", "costmodel.search_algorithmic=true"]


def _columns(tab: Table) -> dict[str, np.ndarray]:
    """Every column of a table flattened to 'path' -> array (an independent walk of the fields)."""
    out = {}

    def walk(prefix, x):
        if isinstance(x, np.ndarray):
            out[prefix] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}[{k}]", v)
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                walk(f"{prefix}.{f.name}", getattr(x, f.name))

    walk("", tab)
    return out


@pytest.fixture(scope="module")
def ctx_tab():
    ctx = CX.make_context(load_config(None, WORKLOAD), 8, GH)
    tab = SC.family_table(ctx, ctx.base, "colocated", {})
    assert tab is not None and len(tab) > 20
    return ctx, tab


def test_take_indexes_every_column_alike(ctx_tab):
    _, tab = ctx_tab
    assert set(tab.continuous) == {1, 2}  # the nested columns exist, so the walk below covers them
    idx = np.arange(len(tab))[::-3]
    sub = tab.take(idx)
    cols, sub_cols = _columns(tab), _columns(sub)
    assert cols.keys() == sub_cols.keys() and len(cols) >= 40
    for name, col in cols.items():
        np.testing.assert_array_equal(sub_cols[name], col[idx], err_msg=name)
    assert sub.considered == tab.considered and len(sub) == len(idx)


def test_build_over_two_group_options_is_the_concatenation_of_each(ctx_tab):
    ctx, _ = ctx_tab
    roles = CX.roles_of(ctx, ctx.base)
    kw = dict(placement="colocated", tensor_sizes=(1, 2, 4, 8), max_staleness=2, continuous=True)
    both = C.build(ctx.st, roles, allocs=[(4, 4), (8, 8)], **kw)
    a, b = (C.build(ctx.st, roles, allocs=[g], **kw) for g in ((4, 4), (8, 8)))
    cat = Table.concat([a, b])
    assert both.considered == a.considered + b.considered == cat.considered
    got, want = _columns(both), _columns(cat)
    assert got.keys() == want.keys()
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert set(both.n_gen.tolist()) == {4, 8}


def test_a_graph_is_priced_with_its_admission_modes_columns(ctx_tab):
    ctx, tab = ctx_tab
    step = apply_pipeline(ctx.base, PipelineConfig(placement="colocated", staleness=1), "step")
    cont = apply_pipeline(ctx.base, PipelineConfig(placement="colocated", staleness=1), "continuous")
    d_step, _ = SC.durations(ctx, step, tab)
    d_cont, _ = SC.durations(ctx, cont, tab)
    np.testing.assert_array_equal(d_step["generate"], tab.t_gen)
    np.testing.assert_array_equal(d_cont["generate"], tab.continuous[1].t_gen)
    np.testing.assert_array_equal(d_cont["actor_update"], tab.continuous[1].train.t_upd["actor"])
    np.testing.assert_array_equal(d_step["actor_update"], tab.train.t_upd["actor"])
    assert not np.array_equal(tab.t_gen, tab.continuous[1].t_gen)  # the two modes differ here


def test_concat_refuses_tables_of_different_columns(ctx_tab):
    _, tab = ctx_tab
    other = tab.replace(continuous={1: tab.continuous[1]})
    with pytest.raises(ValueError, match="different columns"):
        Table.concat([tab, other])


@pytest.mark.parametrize(
    "fn, args",
    [
        (S.train_stage, (1, 1, 1, 1, 1, "none")),
        (S.forward_stage, (1, 1, 1, 1, 1)),
        (S.generate_stage, (1, 1, 1)),
        (S.weight_sync_stage, (True, 1, 1, 1, 1)),
    ],
)
def test_pricing_calls_take_layouts_by_keyword_only(ctx_tab, fn, args):
    ctx, _ = ctx_tab
    ms = CX.roles_of(ctx, ctx.base).actor
    with pytest.raises(TypeError, match="positional"):
        fn(ctx.st, ms, *args)
