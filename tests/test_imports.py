"""The core's modules import each other without a cycle.

Every import of every ``slim_nanguard/*.py`` counts: at the top, inside a function, and under
``if TYPE_CHECKING:``. A cycle hidden behind a local import is still a cycle: the two modules
cannot be understood, or moved, one without the other.
"""

import ast
import pathlib
from typing import Dict, List, Set

import source_trees

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "slim_nanguard"


def import_graph(root: pathlib.Path) -> Dict[str, Set[str]]:
    """{module: the modules of the package it imports}, for each ``<root>/*.py``; a name
    imported from the package itself (``from slim_nanguard import train``) is ``__init__``."""
    modules = {path.stem: path for path in root.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(source_trees.parse(path)):
            if isinstance(node, ast.Import):
                targets = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # relative: from . import x, from ._x import y
                    module = f"{PACKAGE}.{module}".rstrip(".")
                targets = [(module, alias.name) for alias in node.names]
            else:
                continue
            for module, imported in targets:
                parts = module.split(".")
                if parts[0] != PACKAGE:
                    continue
                if len(parts) > 1:
                    found.add(parts[1])
                elif imported in modules:
                    found.add(imported)
                else:
                    found.add("__init__")
        found.discard(name)
        graph[name] = found & set(modules)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle through each module that is on one (a path that comes back to its start)."""
    found, done = [], set()
    for start in sorted(graph):
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    cycle = path + [start]
                    if not set(cycle) <= done:
                        found.append(cycle)
                        done |= set(cycle)
                    stack.clear()
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def test_the_core_has_no_import_cycle():
    graph = import_graph(REPO / PACKAGE)
    assert len(graph) > 30 and "__init__" in graph
    assert not cycles(graph), "import cycles: " + "; ".join(" -> ".join(c) for c in cycles(graph))


def test_the_scan_sees_local_and_type_checking_imports(tmp_path):
    """The test above must be able to fail: a cycle behind a function-local import, one behind
    ``if TYPE_CHECKING:``, and one through the package's ``__init__``."""
    (tmp_path / "__init__.py").write_text("from slim_nanguard._e import E\n")
    (tmp_path / "_a.py").write_text("def f():\n    from slim_nanguard import _b\n")
    (tmp_path / "_b.py").write_text("from slim_nanguard._a import f\n")
    (tmp_path / "_c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import _d\n"
    )
    (tmp_path / "_d.py").write_text("import slim_nanguard._c\n")
    (tmp_path / "_e.py").write_text("from slim_nanguard import train\nE = 1\n")
    (tmp_path / "_f.py").write_text("import os\nfrom slim_nanguard import _a\n")
    graph = import_graph(tmp_path)
    assert graph["_a"] == {"_b"} and graph["_c"] == {"_d"} and graph["_e"] == {"__init__"}
    assert sorted(sorted(set(c)) for c in cycles(graph)) == [
        ["__init__", "_e"],
        ["_a", "_b"],
        ["_c", "_d"],
    ]
