"""`parse`: `ast.parse` of a source file, proof against CPython 3.11's spurious SystemError.

CPython 3.11 before 3.11.8 can raise ``SystemError: AST constructor recursion depth mismatch``
from `ast.parse` of a valid file while other threads run (python/cpython#106905); the
suite's TensorFlow sessions leave such threads. The parse is pure, so it is simply repeated.
"""

import ast
import pathlib
from typing import Union

_TRIES = 5


def parse(path: Union[str, pathlib.Path]) -> ast.Module:
    """The syntax tree of the file at `path` (`ast.parse`, with the file name)."""
    source = pathlib.Path(path).read_text()
    for _ in range(_TRIES - 1):
        try:
            return ast.parse(source, filename=str(path))
        except SystemError as err:
            if "recursion depth mismatch" not in str(err):
                raise
    return ast.parse(source, filename=str(path))
