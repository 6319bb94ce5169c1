"""The packages import downward only — planner → cost_model → passes → runtime — and no modules
import each other in a circle (function-level imports included)."""
import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLOORS = ["planner", "cost_model", "passes", "runtime"]  # highest first


def _imports() -> nx.DiGraph:
    graph = nx.DiGraph()
    for floor in FLOORS:
        for path in (ROOT / floor).glob("*.py"):
            module = f"{floor}.{path.stem}" if path.stem != "__init__" else floor
            graph.add_node(module)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 1:
                    names = [f"{floor}.{node.module}" if node.module else floor]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    if name.split(".")[0] in FLOORS and name != module:
                        graph.add_edge(module, name)
    return graph


def test_imports_point_downward_only():
    upward = [(a, b) for a, b in _imports().edges
              if FLOORS.index(b.split(".")[0]) < FLOORS.index(a.split(".")[0])]
    assert upward == []


def test_no_module_imports_itself_through_others():
    graph = _imports()
    graph.remove_nodes_from([n for n in list(graph) if n in FLOORS])  # package __init__s
    modules = {n for n in graph if (ROOT / (n.replace(".", "/") + ".py")).exists()}
    assert list(nx.simple_cycles(graph.subgraph(modules))) == []
