"""Graph exports: JSON round trip to an equal graph; DOT and Mermaid checked by small parsers."""

import json
import re

import pytest

from rpeg_jax.cli import main
from rpeg_jax.config import load_config
from rpeg_jax.graph.algorithms import build_graph
from rpeg_jax.graph.export import from_json, mermaid_id, to_dot, to_json, to_mermaid
from rpeg_jax.graph.ir import DataNode, GraphError, Stage, StateNode
from rpeg_jax.graph.passes import apply_pipeline

SIZES = ["data.prompts_per_step=4", "rl.group_size=2", "data.max_prompt_len=5", "rollout.max_new_tokens=7"]
VARIANTS = [
    [],
    ["rl.kl_coef=0.1", "pipeline.staleness=2", "pipeline.fuse=[forwards,advantage]", "pipeline.pieces=2"],
    [
        "rl.algorithm=ppo",
        "rl.kl_coef=0.1",
        "pipeline.share_actor_critic=true",
        "pipeline.fuse=[forwards]",
        "pipeline.placement=split",
        "pipeline.split_sizes=[1,3]",
        "rl.tis_cap=2.0",
    ],
    ["rl.algorithm=ppo", "pipeline.elide_old_forward=true", "pipeline.fuse=[advantage]", "pipeline.pieces=4"],
]


def graphs():
    for over in VARIANTS:
        cfg = load_config(None, [*SIZES, *over])
        base = build_graph(cfg)
        yield base
        yield apply_pipeline(base, cfg.pipeline)


def test_json_round_trip_gives_an_equal_graph():
    for g in graphs():
        text = to_json(g)
        back = from_json(text)
        assert back == g
        assert to_json(back) == text
        assert json.loads(text)["format"] == "rpeg"


def test_json_rejects_foreign_documents():
    with pytest.raises(GraphError, match="not an RPEG"):
        from_json('{"format": "other"}')
    with pytest.raises(GraphError, match="invalid JSON"):
        from_json("{")
    doc = json.loads(to_json(next(graphs())))
    doc["edges"] = [e for e in doc["edges"] if e["dst"] != "rewards"]  # drop the producer edge
    with pytest.raises(GraphError, match="no producer"):
        from_json(json.dumps(doc))


# ---- DOT: a small parser for the subset we emit -------------------------------------------------
TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|(->|[{}\[\];,=])|([A-Za-z_][\w.]*|#?\w+))')


def tokenize(text):
    pos, out = 0, []
    text = text.rstrip()
    while pos < len(text):
        m = TOKEN.match(text, pos)
        assert m and m.end() > pos, f"bad DOT at {text[pos : pos + 30]!r}"
        out.append(next(x for x in m.groups() if x is not None))
        pos = m.end()
    return out


def unquote(tok):
    return json.loads(tok) if tok.startswith('"') else tok


def parse_dot(text):
    """-> (graph attrs, {node: attrs}, [(src, dst, attrs)]); asserts the grammar."""
    toks = tokenize(text)
    assert toks[:3] == ["digraph", "rpeg", "{"] and toks[-1] == "}"
    toks, i = toks[3:-1], 0
    gattrs, nodes, edges = {}, {}, []

    def attr_list(i):
        attrs = {}
        assert toks[i] == "["
        i += 1
        while toks[i] != "]":
            k, eq, v = toks[i : i + 3]
            assert eq == "=", toks[i : i + 3]
            attrs[k] = unquote(v)
            i += 3
            if toks[i] == ",":
                i += 1
        return attrs, i + 1

    while i < len(toks):
        a = toks[i]
        if toks[i + 1] == "=":
            gattrs[a] = unquote(toks[i + 2])
            i += 3
        elif toks[i + 1] == "->":
            src, dst, i = unquote(a), unquote(toks[i + 2]), i + 3
            attrs = {}
            if toks[i] == "[":
                attrs, i = attr_list(i)
            edges.append((src, dst, attrs))
        else:
            attrs, i = attr_list(i + 1)
            if a != "node":
                name = unquote(a)
                assert name not in nodes, f"node {name} declared twice"
                nodes[name] = attrs
        assert toks[i] == ";", toks[i - 2 : i + 1]
        i += 1
    return gattrs, nodes, edges


def test_dot_is_well_formed_and_matches_the_graph():
    shapes = {Stage: "box", DataNode: "note", StateNode: "cylinder"}
    for g in graphs():
        gattrs, nodes, edges = parse_dot(to_dot(g))
        assert gattrs["rankdir"] == "LR"
        assert set(nodes) == set(g.nodes)
        for name, attrs in nodes.items():
            assert attrs["shape"] == shapes[type(g.nodes[name])]
            assert attrs["label"].split("\\n")[0].startswith(name)
        assert [(s, d) for s, d, _ in edges] == [(e.src, e.dst) for e in g.edges]
        for (s, d, attrs), e in zip(edges, g.edges):
            if isinstance(g.nodes[s], StateNode) or isinstance(g.nodes[d], StateNode):
                want = "t" if e.offset == 0 else f"t{e.offset:+d}"
                assert attrs["style"] == "dashed" and attrs["label"].split()[0] == want
            assert ("stream" in attrs.get("label", "")) == e.stream


def test_dot_shows_staleness_and_fused_parts():
    cfg = load_config(None, [*SIZES, *VARIANTS[1][:]])
    g = apply_pipeline(build_graph(cfg), cfg.pipeline)
    _, nodes, edges = parse_dot(to_dot(g))
    assert ("rollout_weights", "generate", {"label": "t-2", "style": "dashed"}) in edges
    assert "= ref_forward + old_forward" in nodes["forwards"]["label"]


# ---- Mermaid: structural check ---------------------------------------------------------------
NODE = re.compile(r'^  (\w+)(\["([^"]*)"\]|\(\["([^"]*)"\]\)|\[\("([^"]*)"\)\])$')
EDGE = re.compile(r'^  (\w+) (-->|-\.->|==>)(?:\|"([^"]*)"\|)? (\w+)$')


def test_mermaid_is_structurally_valid():
    for g in graphs():
        lines = to_mermaid(g).splitlines()
        assert lines[0] == "flowchart LR"
        ids, edges = {}, []
        for line in lines[1:]:
            m, e = NODE.match(line), EDGE.match(line)
            assert m or e, f"unparseable Mermaid line {line!r}"
            if m:
                assert m.group(1) not in ids, f"duplicate id {m.group(1)}"
                ids[m.group(1)] = m.group(2)[0:2]
            else:
                assert e.group(1) in ids and e.group(4) in ids, f"edge to undeclared node: {line}"
                edges.append((e.group(1), e.group(2), e.group(4)))
        assert ids == {
            mermaid_id(n): {Stage: '["', DataNode: "([", StateNode: "[("}[type(v)] for n, v in g.nodes.items()
        }
        assert len(edges) == len(g.edges)
        for (s, arrow, d), edge in zip(edges, g.edges):
            state = isinstance(g.nodes[edge.src], StateNode) or isinstance(g.nodes[edge.dst], StateNode)
            assert arrow == ("-.->" if state else "==>" if edge.stream else "-->")
            assert (s, d) == (mermaid_id(edge.src), mermaid_id(edge.dst))


def test_mermaid_ids_are_safe_and_distinct():
    names = ["advantage+actor_update", "advantage_actor_update", "end", "forwards"]
    ids = [mermaid_id(n) for n in names]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"\w+", i) for i in ids) and "end" not in ids


# ---- the command ------------------------------------------------------------------------------
def test_rpeg_graph_command(capsys):
    over = [*SIZES, "rl.kl_coef=0.1", "pipeline.fuse=[forwards]"]
    assert main(["graph", "--format", "json", *over]) == 0
    after = from_json(capsys.readouterr().out)
    assert "forwards" in after.stage_names()
    assert main(["graph", "--format", "json", "--before", *over]) == 0
    before = from_json(capsys.readouterr().out)
    assert before == build_graph(load_config(None, over))
    assert main(["graph", "--format", "mermaid", *over]) == 0
    assert capsys.readouterr().out.startswith("flowchart LR")
    assert main(["graph", "--format", "dot", *over]) == 0
    parse_dot(capsys.readouterr().out)
    assert main(["graph", "--devices", "4", *over]) == 0
    out = capsys.readouterr().out
    assert "forwards" in out and "plan (manual) for 4 devices" in out
    assert main(["graph", *SIZES, "pipeline.pieces=3"]) == 2  # one line naming the stage
    assert "'generate'" in capsys.readouterr().err


def test_the_checkers_reject_malformed_text():
    good = to_dot(next(graphs()))
    for bad in (
        good.replace(";", "", 1 + good.count(";") // 2),
        good.replace("}", ""),
        good.replace('"generate" [', '"generate [', 1),
    ):
        with pytest.raises((AssertionError, IndexError)):
            parse_dot(bad)
    assert not NODE.match('  a["x"y"]') and not EDGE.match("  a --> ")
