"""The core stays readable in small pieces: no function of ``slim_nanguard/*.py`` has more than
60 lines of code, and `Guard`, the holder every loop reads, stays under 100 lines.

A line of code is a line that is not blank, not a comment and not part of a docstring.
"""

import ast
import pathlib
from typing import Dict, Iterator, Set, Tuple

import source_trees

REPO = pathlib.Path(__file__).resolve().parents[1]
CORE = REPO / "slim_nanguard"
MAX_FUNCTION_CODE_LINES = 60
MAX_GUARD_LINES = 100


def _docstring_lines(tree: ast.Module) -> Set[int]:
    """The line numbers of every docstring in `tree` (module, class and function)."""
    found = set()
    for node in ast.walk(tree):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and ast.get_docstring(node, clean=False) is not None:
            first = node.body[0]
            found.update(range(first.lineno, first.end_lineno + 1))
    return found


def function_sizes(path: pathlib.Path) -> Iterator[Tuple[str, int]]:
    """``(qualified name, lines of code)`` of every function and method in the file at `path`."""
    tree = source_trees.parse(path)
    lines, docs = path.read_text().splitlines(), _docstring_lines(tree)

    def code(node) -> int:
        return sum(
            1
            for number in range(node.lineno, node.end_lineno + 1)
            if number not in docs
            and lines[number - 1].strip()
            and not lines[number - 1].strip().startswith("#")
        )

    def visit(node, prefix: str) -> Iterator[Tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, code(child)
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")

    yield from visit(tree, "")


def class_lengths(path: pathlib.Path) -> Dict[str, int]:
    """Each top-level class of the file at `path`: its lines, first to last."""
    tree = source_trees.parse(path)
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def test_no_core_function_has_more_than_60_lines_of_code():
    sizes = {
        f"{path.name}:{name}": size
        for path in CORE.glob("*.py")
        for name, size in function_sizes(path)
    }
    assert len(sizes) > 300  # The scan saw the core.
    long = {name: size for name, size in sizes.items() if size > MAX_FUNCTION_CODE_LINES}
    assert not long, f"functions over {MAX_FUNCTION_CODE_LINES} lines of code: {long}"


def test_the_guard_class_is_under_100_lines():
    length = class_lengths(CORE / "_guard.py")["Guard"]
    assert length < MAX_GUARD_LINES, f"Guard is {length} lines"


def test_the_scan_counts_code_not_docstrings_comments_or_blank_lines(tmp_path):
    """The tests above must be able to fail: a method of 62 lines of code (its ``def`` line
    counts) is seen, and one of 60 padded with a docstring, a comment and a blank line is 60."""
    body = "".join(f"        x{i} = {i}\n" for i in range(60))
    padding = '        """A docstring\n        on two lines."""\n        # a comment\n\n'
    (tmp_path / "m.py").write_text(
        "class C:\n"
        f"    def long(self):\n{body}        return x0\n"
        f"    def padded(self):\n{padding}{''.join(body.splitlines(True)[:59])}"
    )
    sizes = dict(function_sizes(tmp_path / "m.py"))
    assert sizes == {"C.long": 62, "C.padded": 60}
    assert class_lengths(tmp_path / "m.py") == {"C": 1 + 62 + 1 + 4 + 59}
