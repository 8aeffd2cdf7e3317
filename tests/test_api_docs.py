"""docs/api.md shows every public signature whole, as the code has it.

The public API is ``slim_nanguard.__all__`` and the public modules' names (``__all__``, or for
``autopsy`` the functions it defines). Each callable's signature is rendered here from
``inspect.signature`` (without annotations, one parameter a line when it is long), and
docs/api.md must hold each rendering verbatim in a ```python block, and no signature the code
lacks. To regenerate the blocks after an API change::

    python3 tests/test_api_docs.py
"""

import enum
import inspect
import pathlib
import re

import slim_nanguard

REPO = pathlib.Path(__file__).resolve().parents[1]
API = REPO / "docs" / "api.md"
MODULES = ("autopsy", "cluster", "compat", "quarantine", "storage")
WIDTH = 96


def _public_names(module) -> list:
    names = getattr(module, "__all__", None)
    if names is None:  # slim_nanguard.autopsy: the functions it defines.
        names = [
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and inspect.isfunction(value)
            and value.__module__ == module.__name__
        ]
    return [name for name in names if not inspect.ismodule(getattr(module, name))]


def _parameter(param: inspect.Parameter) -> str:
    param = param.replace(annotation=inspect.Parameter.empty)
    default = param.default
    if default is not inspect.Parameter.empty and "<" in repr(default):
        return f"{param.name}=..."  # a function or a dataclass field's factory
    if isinstance(default, str) and '"' not in default and "\\" not in default:
        return f'{param.name}="{default}"'  # as ruff formats the page's python blocks
    return str(param)


def render(qualname: str, obj) -> str | None:
    """The signature docs/api.md shows for `obj`, or None (no signature: an enum, or an
    exception that takes what Exception takes)."""
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return None
    try:
        signature = inspect.signature(obj)
    except ValueError:
        return None
    params = [_parameter(p) for p in signature.parameters.values()]
    pieces, star_done = [], False
    for raw, text in zip(signature.parameters.values(), params):
        if raw.kind is inspect.Parameter.KEYWORD_ONLY and not star_done:
            pieces.append("*")
        if raw.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.KEYWORD_ONLY):
            star_done = True
        pieces.append(text)
    one_line = f"{qualname}({', '.join(pieces)})"
    if len(one_line) <= WIDTH:
        return one_line
    return f"{qualname}(\n" + "".join(f"    {piece},\n" for piece in pieces) + ")"


def all_signatures() -> dict:
    """``{qualified name: rendering}`` of every public callable with a signature."""
    found = {}
    for name in _public_names(slim_nanguard):
        text = render(name, getattr(slim_nanguard, name))
        if text:
            found[name] = text
    for module_name in MODULES:
        module = getattr(slim_nanguard, module_name)
        for name in _public_names(module):
            qualname = f"{module_name}.{name}"
            text = render(qualname, getattr(module, name))
            if text:
                found[qualname] = text
    return found


# One signature: ``name(...)`` on one line, or ``name(`` to a line holding ``)`` alone.
_SIGNATURE = re.compile(r"^([\w.]+)\((?:[^\n]*\)$|\n.*?^\)$)", flags=re.M | re.S)


def _documented() -> dict:
    """``{name: text}`` of each signature in docs/api.md's ```python blocks."""
    blocks = re.findall(r"^```python\n(.*?)^```$", API.read_text(), flags=re.S | re.M)
    spans = list(_SIGNATURE.finditer("\n".join(blocks)))
    documented = {m.group(1): m.group(0) for m in spans}
    assert len(spans) == len(documented), "docs/api.md shows a signature twice"
    return documented


def test_api_md_shows_every_public_signature_as_the_code_has_it():
    code, documented = all_signatures(), _documented()
    assert len(code) > 40
    missing = sorted(set(code) - set(documented))
    assert not missing, f"docs/api.md shows no signature of {missing}"
    stale = sorted(set(documented) - set(code))
    assert not stale, f"docs/api.md shows signatures of {stale}, which the code lacks"
    wrong = [name for name in code if documented[name] != code[name]]
    assert not wrong, "docs/api.md's signature differs from the code's:\n" + "\n".join(
        f"{code[name]}\n  (docs: {documented[name]})" for name in wrong
    )


def test_the_checker_sees_a_hidden_keyword():
    shown = render("train", slim_nanguard.train)
    assert "task=None" in shown and "..." not in shown
    cut = shown.replace("    task=None,\n", "")
    assert cut != shown


if __name__ == "__main__":
    for text in all_signatures().values():
        print(text)
