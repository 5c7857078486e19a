"""Exports of an RPEG: JSON (lossless round trip), Graphviz DOT and Mermaid (for people).

Called by `rpeg graph` and by anyone saving a graph next to a run. Drawing conventions (both
DOT and Mermaid): stages are boxes (fused stages list their parts), data nodes are notes /
stadiums labelled with their spec, state nodes are cylinders; state edges are dashed and carry
the version offset (`t-1`, `t+1`), streamed data edges are bold and marked `stream`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from rpeg_jax.graph.ir import (
    DataNode,
    DataSpec,
    Edge,
    Graph,
    GraphError,
    ModelDims,
    Op,
    Stage,
    StageKind,
    StageOptions,
    StateKind,
    StateNode,
    Workload,
)

FORMAT_VERSION = 2  # 2: typed stage options (StageOptions) instead of free attrs


# ---- JSON -------------------------------------------------------------------------------------
def _spec_to(s: DataSpec | None) -> dict | None:
    return None if s is None else {"dims": list(s.dims), "shape": list(s.shape), "dtype": s.dtype, "axes": list(s.axes)}


def _spec_from(d: dict | None) -> DataSpec | None:
    return None if d is None else DataSpec(tuple(d["dims"]), tuple(d["shape"]), d["dtype"], tuple(d["axes"]))


def _work_to(w: Workload | None) -> dict | None:
    if w is None:
        return None
    out = {k: getattr(w, k) for k in Workload.__dataclass_fields__}
    out["op"] = w.op.value
    out["models"] = [dict(m.__dict__) for m in w.models]
    out["heads"] = list(w.heads)
    return out


def _work_from(d: dict | None) -> Workload | None:
    if d is None:
        return None
    d = dict(d)
    d["op"] = Op(d["op"])
    d["models"] = tuple(ModelDims(**m) for m in d["models"])
    d["heads"] = tuple(d["heads"])
    return Workload(**d)


def _stage_to(s: Stage) -> dict:
    return {
        "type": "stage",
        "name": s.name,
        "kind": s.kind.value,
        "workload": _work_to(s.workload),
        "placement": s.placement,
        "pieces": s.pieces,
        "parts": [_stage_to(p) for p in s.parts],
        "options": dataclasses.asdict(s.options),
    }


def _stage_from(d: dict) -> Stage:
    return Stage(
        d["name"],
        StageKind(d["kind"]),
        workload=_work_from(d["workload"]),
        placement=d["placement"],
        pieces=d["pieces"],
        parts=tuple(_stage_from(p) for p in d["parts"]),
        options=_options_from(d["options"], d["name"]),
    )


def _options_from(d: dict, stage: str) -> StageOptions:
    known = {f.name for f in dataclasses.fields(StageOptions)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise GraphError(stage, f"unknown stage options {unknown}; known: {sorted(known)}")
    return StageOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _node_to(n) -> dict:
    if isinstance(n, Stage):
        return _stage_to(n)
    if isinstance(n, DataNode):
        return {"type": "data", "name": n.name, "spec": _spec_to(n.spec)}
    return {
        "type": "state",
        "name": n.name,
        "kind": n.kind.value,
        "bytes": n.bytes,
        "frozen": n.frozen,
        "placement": n.placement,
    }


def _node_from(d: dict):
    kind = d.get("type")
    if kind == "stage":
        return _stage_from(d)
    if kind == "data":
        return DataNode(d["name"], _spec_from(d["spec"]))
    if kind == "state":
        return StateNode(
            d["name"], StateKind(d["kind"]), bytes=d["bytes"], frozen=d["frozen"], placement=d["placement"]
        )
    raise GraphError(str(d.get("name")), f"unknown node type {kind!r} in JSON")


def graph_to_dict(g: Graph) -> dict[str, Any]:
    return {
        "format": "rpeg",
        "version": FORMAT_VERSION,
        "sizes": g.sizes,
        "attrs": g.attrs,
        "nodes": [_node_to(n) for n in g.nodes.values()],
        "edges": [
            {
                "src": e.src,
                "dst": e.dst,
                "offset": e.offset,
                "port": e.port,
                "expect": _spec_to(e.expect),
                "stream": e.stream,
            }
            for e in g.edges
        ],
    }


def graph_from_dict(d: dict[str, Any]) -> Graph:
    if d.get("format") != "rpeg" or d.get("version") != FORMAT_VERSION:
        raise GraphError(
            "json", f"not an RPEG v{FORMAT_VERSION} document (format={d.get('format')!r}, version={d.get('version')!r})"
        )
    g = Graph(sizes=dict(d["sizes"]), attrs=dict(d["attrs"]))
    for n in d["nodes"]:
        g.add(_node_from(n))
    g.edges = [
        Edge(e["src"], e["dst"], offset=e["offset"], port=e["port"], expect=_spec_from(e["expect"]), stream=e["stream"])
        for e in d["edges"]
    ]
    return g


def to_json(g: Graph) -> str:
    return json.dumps(graph_to_dict(g), indent=1)


def from_json(text: str) -> Graph:
    """The graph a `to_json` wrote (validated)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise GraphError("json", f"invalid JSON: {e}") from None
    return graph_from_dict(data).validate()


# ---- DOT and Mermaid --------------------------------------------------------------------------
def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _label(g: Graph, name: str) -> list[str]:
    """Lines of a node's label."""
    n = g.nodes[name]
    if isinstance(n, Stage):
        lines = [n.name + (f" x{n.pieces}" if n.pieces > 1 else "")]
        if n.parts:
            lines.append("= " + " + ".join(p.name for p in n.parts))
        elif n.workload.op.value != n.name:
            lines.append(n.workload.op.value)
        if n.placement != "all":
            lines.append(f"on {n.placement}")
        return lines
    if isinstance(n, DataNode):
        return [n.name, str(n.spec)]
    extra = ["frozen"] if n.frozen else []
    if n.kind == StateKind.ROLLOUT_BUFFER:
        extra.append(f"k={g.staleness}")
    return [n.name, _fmt_bytes(n.bytes)] + extra if n.bytes else [n.name] + extra


def _edge_text(g: Graph, e: Edge) -> str:
    parts = []
    if isinstance(g.nodes[e.src], StateNode) or isinstance(g.nodes[e.dst], StateNode):
        parts.append("t" if e.offset == 0 else f"t{e.offset:+d}")
    if e.port and e.port not in (e.src, e.dst):
        parts.append(f"as {e.port}")
    if e.stream:
        parts.append("stream")
    return " ".join(parts)


def _dot_q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(g: Graph) -> str:
    title = f"RPEG {g.attrs.get('algorithm', '')} passes: {', '.join(g.attrs.get('passes', [])) or 'none'}"
    out = ["digraph rpeg {", "  rankdir=LR;", f"  label={_dot_q(title)};", "  node [fontname=Helvetica];"]
    shapes = {
        Stage: 'shape=box, style="rounded,filled", fillcolor="#dbe9f6"',
        DataNode: "shape=note",
        StateNode: 'shape=cylinder, style=filled, fillcolor="#f6ecd9"',
    }
    for name, n in g.nodes.items():
        label = "\\n".join(line.replace("\\", "\\\\").replace('"', '\\"') for line in _label(g, name))
        out.append(f'  {_dot_q(name)} [{shapes[type(n)]}, label="{label}"];')
    for e in g.edges:
        attrs = []
        text = _edge_text(g, e)
        if text:
            attrs.append(f"label={_dot_q(text)}")
        if isinstance(g.nodes[e.src], StateNode) or isinstance(g.nodes[e.dst], StateNode):
            attrs.append("style=dashed")
        if e.stream:
            attrs.append("penwidth=2")
        out.append(f"  {_dot_q(e.src)} -> {_dot_q(e.dst)}" + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    out.append("}")
    return "\n".join(out) + "\n"


def mermaid_id(name: str) -> str:
    """A Mermaid node id (word characters only), stable and unique per name."""
    safe = re.sub(r"\W", "_", name)
    if safe.lower() in ("end", "graph", "subgraph", "flowchart", "style", "class"):
        safe += "_"  # Mermaid keywords cannot be ids
    return safe if safe == name else f"{safe}_{sum(map(ord, name)) % 997}"


def _mm_text(s: str) -> str:
    return s.replace('"', "#quot;")


def to_mermaid(g: Graph) -> str:
    out = ["flowchart LR"]
    for name, n in g.nodes.items():
        text = _mm_text("<br/>".join(_label(g, name)))
        if isinstance(n, Stage):
            out.append(f'  {mermaid_id(name)}["{text}"]')
        elif isinstance(n, DataNode):
            out.append(f'  {mermaid_id(name)}(["{text}"])')
        else:
            out.append(f'  {mermaid_id(name)}[("{text}")]')
    for e in g.edges:
        state = isinstance(g.nodes[e.src], StateNode) or isinstance(g.nodes[e.dst], StateNode)
        arrow = "-.->" if state else ("==>" if e.stream else "-->")
        text = _edge_text(g, e)
        label = f'|"{_mm_text(text)}"|' if text else ""
        out.append(f"  {mermaid_id(e.src)} {arrow}{label} {mermaid_id(e.dst)}")
    return "\n".join(out) + "\n"
