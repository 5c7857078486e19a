"""The package layers, read from the source: every import statement in rpeg_jax/ and launch/,
the ones inside functions included, checked against the table of who may import whom; and the
import graph of the modules (all imports again) has no cycle.

The layers (config and shapes are the floor every package may import):
    cli (rpeg_jax/cli/), launch/  -> anything
    calibration -> costmodel, graph, sampling, rl, sharding, models   (measures with JAX; the fits
                                       are the cost model's)
    runtime    -> graph, costmodel, sampling, rl, sharding, models, data, env
    env        -> data                (environments and tools: host Python, no JAX)
    graph      -> sharding            (only graph/compile.py imports JAX)
    costmodel  -> graph               (no JAX at import time: inside functions only)
    sampling   -> models, sharding
    rl, models, data -> sharding
    sharding, config -> nothing else  (config imports no JAX)
    shapes     -> nothing             (the rules the program and the cost model share: no JAX, no
                                       other rpeg_jax package)
Imports by string (importlib: the cli dispatcher, user plugins) are not statements and not seen.
What a package pulls in transitively at import time (no JAX under the planner, no numpy under the
graph) is checked by importing it in a fresh process: tests/test_costmodel_planner.py,
tests/test_graph_ir.py.
"""

from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("rpeg_jax", "launch")
FLOOR = ("config", "shapes")  # every package may import these
ANY = None
ALLOWED: dict[str, set[str] | None] = {
    "cli": ANY,
    "launch": ANY,
    "calibration": {"costmodel", "graph", "sampling", "rl", "sharding", "models"},
    "runtime": {"graph", "costmodel", "sampling", "rl", "sharding", "models", "data", "env"},
    "env": {"data"},
    "graph": {"sharding"},
    "costmodel": {"graph"},
    "sampling": {"models", "sharding"},
    "rl": {"sharding"},
    "models": {"sharding"},
    "data": {"sharding"},
    "sharding": set(),
    "config": set(),
    "shapes": set(),
    "rpeg_jax": set(),  # the root package's __init__
}
# Imports that break the table today, each with its file and why: (importing module, imported
# package) -> reason. Keep it empty; an entry is a debt to pay, not a rule.
EXCEPTIONS: dict[tuple[str, str], str] = {}
DEVICE_LIBS = ("jax", "jaxlib", "flax", "optax", "orbax", "chex")
NO_DEVICE_CODE = {  # package -> where it may not import DEVICE_LIBS ("anywhere" | "module level")
    "config": "anywhere",
    "graph": "anywhere",
    "costmodel": "module level",
    "shapes": "anywhere",
    "env": "anywhere",
}
MAY_IMPORT_JAX = {"rpeg_jax.graph.compile"}  # the stage compiler binds stages to jitted programs


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (a package's __init__ when the name is not a module)
    line: int
    top: bool  # at module level (run at import time), not inside a function or class body


@functools.cache
def read_sources(root: str = ROOT) -> dict[str, str]:
    """module name -> source text for every .py file under SOURCES."""
    out = {}
    for top in SOURCES:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    with open(path) as fh:
                        out[module_name(os.path.relpath(path, root))] = fh.read()
    return out


def module_name(relpath: str) -> str:
    parts = relpath[:-3].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(module: str, sources: dict[str, str]) -> bool:
    return any(m.startswith(module + ".") for m in sources)


def imports(module: str, source: str, sources: dict[str, str]) -> list[Import]:
    """Every import statement of `module` in line order, resolved to the module it loads."""
    out = []

    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package of `module`
                    pkg = module if _is_package(module, sources) else module.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                # `from pkg import sub` loads pkg.sub when that is a module, else pkg's __init__
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base for a in child.names]
            else:  # a function body runs later; a class body or an if/try block at import time
                visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
                continue
            out.extend(Import(module, t, child.lineno, top) for t in dict.fromkeys(targets))

    visit(ast.parse(source), True)
    return sorted(out, key=lambda i: i.line)


def package_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "launch":
        return "launch"
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(sources: dict[str, str], exceptions=EXCEPTIONS) -> list[str]:
    """One line per import that breaks the table (or imports device code where it may not)."""
    bad = []
    for module, source in sorted(sources.items()):
        pkg = package_of(module)
        if pkg not in ALLOWED:
            bad.append(f"{module}: package {pkg!r} is not in the layer table")
            continue
        allowed = ALLOWED[pkg]
        for imp in imports(module, source, sources):
            root = imp.target.split(".")[0]
            if root == "rpeg_jax":
                dst = package_of(imp.target)
                ok = (
                    allowed is ANY
                    or dst == pkg
                    or (dst in FLOOR and pkg != "shapes")
                    or dst in allowed
                    or (module, dst) in exceptions
                )
                if not ok:
                    bad.append(f"{module}:{imp.line}: {pkg} -> {dst} ({imp.target})")
            elif root in DEVICE_LIBS and module not in MAY_IMPORT_JAX:
                where = NO_DEVICE_CODE.get(pkg)
                if where == "anywhere" or (where == "module level" and imp.top):
                    bad.append(f"{module}:{imp.line}: {pkg} imports {imp.target} ({where} forbidden)")
    return bad


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in it). Loading a submodule also runs
    its package's __init__; that implicit edge is left out (it would make every package a cycle)."""
    graph = {m: set() for m in sources}
    for module, source in sources.items():
        for imp in imports(module, source, sources):
            if imp.target in sources and imp.target != module:
                graph[module].add(imp.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# ---- the real tree ------------------------------------------------------------------------------
def test_every_import_respects_the_layers():
    assert layer_violations(read_sources()) == []


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph(read_sources())) == []


def test_exceptions_are_still_needed():
    """An allow-list entry whose import is gone must go too."""
    bad = layer_violations(read_sources(), exceptions={})
    for (module, dst), why in EXCEPTIONS.items():
        assert any(b.startswith(f"{module}:") and f" -> {dst} (" in b for b in bad), (
            f"{module} -> {dst} is gone ({why})"
        )


def test_the_scan_sees_the_tree_and_function_level_imports():
    sources = read_sources()
    assert {"rpeg_jax.cli", "rpeg_jax.graph.ir", "rpeg_jax.costmodel.planner", "launch.multihost"} <= set(sources)
    found = {
        (i.target, i.top) for i in imports("rpeg_jax.runtime.trainer", sources["rpeg_jax.runtime.trainer"], sources)
    }
    assert ("rpeg_jax.costmodel.planner", True) in found  # a module-level import
    graph_ir = {(i.target, i.top) for i in imports("rpeg_jax.graph.ir", sources["rpeg_jax.graph.ir"], sources)}
    passes = {(i.target, i.top) for i in imports("rpeg_jax.graph.plan", sources["rpeg_jax.graph.plan"], sources)}
    assert ("rpeg_jax.graph.ir", True) in passes and ("rpeg_jax.graph.passes", False) in passes  # inside a function
    assert not any(t.startswith("rpeg_jax.graph.plan") for t, _ in graph_ir)
    assert {package_of(m) for m in sources} <= set(ALLOWED)


# ---- the checkers can fail ----------------------------------------------------------------------
SYNTHETIC = {
    "rpeg_jax.sharding.mesh": "import jax\n",
    "rpeg_jax.models.llama": "from rpeg_jax.sharding import mesh\n",
    "rpeg_jax.models": "",
    "rpeg_jax.graph.ir": "import dataclasses\n",
    "rpeg_jax.graph.compile": "import jax\nfrom rpeg_jax.sharding.mesh import make_mesh\n",
    "rpeg_jax.costmodel.microfit": "from rpeg_jax.config import load_config\n\ndef f():\n    import jax\n",
    "rpeg_jax.cli.shardings": "from rpeg_jax.models.llama import Transformer\n",
}


def _with(changes: dict[str, str]) -> dict[str, str]:
    return SYNTHETIC | changes


def test_a_clean_tree_passes():
    assert layer_violations(SYNTHETIC) == [] and cycles(import_graph(SYNTHETIC)) == []


def test_a_function_level_import_against_the_layers_is_reported():
    src = "import math\n\ndef build(cfg):\n    from rpeg_jax.models.llama import Transformer\n    return Transformer\n"
    bad = layer_violations(_with({"rpeg_jax.sharding.cli": src}))
    assert bad == ["rpeg_jax.sharding.cli:4: sharding -> models (rpeg_jax.models.llama)"]


def test_module_level_relative_and_package_imports_are_reported():
    srcs = _with(
        {
            "rpeg_jax.rl.update": "from rpeg_jax.runtime import trainer\n",
            "rpeg_jax.runtime.trainer": "",
            "rpeg_jax.data.pipeline": "from .. import graph\n",
            "rpeg_jax.data": "",
            "rpeg_jax.graph": "",
            "rpeg_jax.costmodel.planner": "import rpeg_jax.sampling.engine as E\n",
        }
    )
    assert layer_violations(srcs) == [
        "rpeg_jax.costmodel.planner:1: costmodel -> sampling (rpeg_jax.sampling.engine)",
        "rpeg_jax.data.pipeline:1: data -> graph (rpeg_jax.graph)",
        "rpeg_jax.rl.update:1: rl -> runtime (rpeg_jax.runtime.trainer)",
    ]


def test_device_code_where_it_may_not_be_is_reported():
    srcs = _with(
        {
            "rpeg_jax.graph.passes": "def f():\n    import jax.numpy as jnp\n",
            "rpeg_jax.costmodel.planner": "import numpy as np\nfrom flax import nnx\n",
            "rpeg_jax.config.run": "try:\n    import jax\nexcept ImportError:\n    pass\n",
        }
    )
    assert layer_violations(srcs) == [
        "rpeg_jax.config.run:2: config imports jax (anywhere forbidden)",
        "rpeg_jax.costmodel.planner:2: costmodel imports flax (module level forbidden)",
        "rpeg_jax.graph.passes:2: graph imports jax.numpy (anywhere forbidden)",
    ]


def test_an_unknown_package_and_an_exception_entry():
    srcs = _with(
        {
            "rpeg_jax.extras.x": "from rpeg_jax.runtime import trainer\n",
            "rpeg_jax.runtime.trainer": "",
            "rpeg_jax.rl.kl": "from rpeg_jax.models.llama import Transformer\n",
        }
    )
    assert layer_violations(srcs) == [
        "rpeg_jax.extras.x: package 'extras' is not in the layer table",
        "rpeg_jax.rl.kl:1: rl -> models (rpeg_jax.models.llama)",
    ]
    assert layer_violations(srcs, exceptions={("rpeg_jax.rl.kl", "models"): "test"})[1:] == []


def test_a_cycle_through_a_function_level_import_is_found():
    srcs = _with(
        {
            "rpeg_jax.graph.ir": "def validate(g):\n    from rpeg_jax.graph import validate\n",
            "rpeg_jax.graph.validate": "from rpeg_jax.graph.ir import Graph\n",
            "rpeg_jax.graph": "",
        }
    )
    assert cycles(import_graph(srcs)) == [["rpeg_jax.graph.ir", "rpeg_jax.graph.validate"]]
    three = {"a": "import b\n", "b": "def f():\n    import c\n", "c": "from a import x\n", "d": "import a\n"}
    assert cycles(import_graph(three)) == [["a", "b", "c"]]
