"""The architecture, enforced. The packages import downward only — planner → cost_model → passes →
runtime — and so do the subpackages inside each package, by the levels below; no modules import
each other in a circle (function-level imports included); the product never imports the test
harnesses (tests.harness)."""
import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLOORS = ["planner", "cost_model", "passes", "runtime"]  # highest first
# Inside each floor, highest first; a unit may import units on lower levels only (not its peers on
# the same level). A unit is a subpackage, or a module directly in the package.
LEVELS = {
    "planner": [["cli"], ["bench"], ["training"], ["interop"], ["api"], ["weights"], ["report"],
                ["search"], ["models"]],
    "cost_model": [["calibration"], ["layers"], ["hardware"], ["ops"]],
    "passes": [["stages"], ["rewrite"], ["capture"]],
    "runtime": [["observe"], ["checkpoint"], ["training"],
                ["pipeline", "data_parallel", "experts", "context"], ["comm"],
                ["programs", "launch", "attention"]],
}


def _modules():
    for floor in FLOORS:
        for path in sorted((ROOT / floor).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imports() -> nx.DiGraph:
    graph = nx.DiGraph()
    for module, path in _modules():
        graph.add_node(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in FLOORS + ["tests"] and name != module:
                    graph.add_edge(module, name)
    return graph


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _level(module: str) -> int | None:
    unit = _unit(module)
    for i, units in enumerate(LEVELS[module.split(".")[0]]):
        if unit in units:
            return i
    return None


def test_every_unit_has_a_level():
    units = {(m.split(".")[0], _unit(m)) for m, _ in _modules() if _unit(m)}
    assert sorted(u for u in units if not any(u[1] in lv for lv in LEVELS[u[0]])) == []


def test_imports_point_downward_only():
    upward = [(a, b) for a, b in _imports().edges if b.split(".")[0] in FLOORS
              and FLOORS.index(b.split(".")[0]) < FLOORS.index(a.split(".")[0])]
    assert upward == []


def test_subpackages_import_lower_levels_only():
    graph = _imports()
    known = set(graph)
    wrong = []
    for a, b in graph.edges:
        if b not in known or a.split(".")[0] != b.split(".")[0] or _unit(b) is None:
            continue  # a name imported from a module, another floor, or a package __init__
        if _unit(a) is not None and _unit(a) != _unit(b) and _level(a) >= _level(b):
            wrong.append((a, b))
    assert wrong == []


def test_the_product_never_imports_the_test_harnesses():
    assert [(a, b) for a, b in _imports().edges if b.split(".")[0] == "tests"] == []


def test_no_module_imports_itself_through_others():
    graph = _imports()
    modules = {n for n, path in _modules() if path.name != "__init__.py"}
    assert list(nx.simple_cycles(graph.subgraph(modules))) == []
