"""The type stub ``kvtier/_native.pyi`` against the built ``kvtier._native``.

The stub is read with ``ast`` (never imported) and compared with the live module: the names it
defines, each class's members (properties for getters, methods for methods), each signature
that pyo3 records in ``__text_signature__`` (parameter names, kinds, which have defaults and
their literal values), and the classes' bases and finality. A change to the Rust side that the
stub does not follow fails here.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

import kvtier._native as native

STUB = Path(__file__).parents[1] / "python" / "kvtier" / "_native.pyi"

# The receiver of a method or constructor, in the stub and in a text signature.
RECEIVERS = {"self", "cls", "$self", "$cls", "$type"}

# ``Py_TPFLAGS_BASETYPE``: the type may be subclassed.
BASETYPE = 1 << 10


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _parse_stub() -> ast.Module:
    return ast.parse(STUB.read_text(encoding="utf-8"), filename=str(STUB))


TREE = _parse_stub()


def _defs(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """The names a module or class body defines (imports aside), each with its node."""
    out: dict[str, ast.stmt] = {}
    for node in body:
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        for name in names:
            assert name not in out, f"the stub defines {name!r} twice (line {node.lineno})"
            out[name] = node
    return out


STUB_TOP = _defs(TREE.body)
STUB_CLASSES = {n: c for n, c in STUB_TOP.items() if isinstance(c, ast.ClassDef)}

MODULE_CLASSES = {
    name: obj
    for name, obj in vars(native).items()
    if not _dunder(name) and isinstance(obj, type)
}


def _module_members(cls: type) -> set[str]:
    names = {n for n in vars(cls) if not _dunder(n)}
    if cls.__text_signature__ is not None:
        names.add("__new__")
    return names


def _stub_members(cls: ast.ClassDef) -> set[str]:
    return {n for n in _defs(cls.body) if not _dunder(n) or n == "__new__"}


def _decorators(node: ast.stmt) -> set[str]:
    out = set()
    for d in getattr(node, "decorator_list", []):
        if isinstance(d, ast.Name):
            out.add(d.id)
        elif isinstance(d, ast.Attribute):
            out.add(d.attr)
    return out


# --- signatures ---------------------------------------------------------------------------

# A parameter as compared: name, kind, and its default: ``NO_DEFAULT`` if it has none, else
# ``(type name, value)`` of the literal (``("ellipsis", ...)`` for ``...``), or
# ``("<expr>", source)`` when it is not a literal.
Param = tuple[str, str, Any]

NO_DEFAULT = object()


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return NO_DEFAULT
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return ("<expr>", ast.unparse(node))
    # ``True == 1`` and ``1 == 1.0``: compare the type as well.
    return (type(value).__name__, value)


def _params(args: ast.arguments) -> list[Param]:
    """The parameters of a parsed signature, receiver dropped, in order."""
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += args.defaults
    out: list[Param] = []
    for i, (a, d) in enumerate(zip(positional, defaults)):
        kind = "positional-only" if i < len(args.posonlyargs) else "positional-or-keyword"
        out.append((a.arg, kind, _default(d)))
    if args.vararg is not None:
        out.append((args.vararg.arg, "var-positional", NO_DEFAULT))
    elif args.kwonlyargs:
        out.append(("*", "keyword-only marker", NO_DEFAULT))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, "keyword-only", _default(d)))
    if args.kwarg is not None:
        out.append((args.kwarg.arg, "var-keyword", NO_DEFAULT))
    return _without_receiver(out)


def _without_receiver(params: list[Param]) -> list[Param]:
    if params and params[0][0] in RECEIVERS and params[0][1].startswith("positional"):
        return params[1:]
    return params


def _text_params(text_signature: str) -> list[Param]:
    """The parameters of a pyo3 ``__text_signature__`` such as ``($self, key, n=4)``."""
    # ``$self`` is not a Python name: parsed as ``_dollar_self``, then named back.
    fn = ast.parse(f"def f{text_signature.replace('$', '_dollar_')}: pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    for a in ast.walk(fn.args):
        if isinstance(a, ast.arg):
            a.arg = a.arg.replace("_dollar_", "$")
    return _params(fn.args)


def _compare(where: str, live: list[Param], stub: list[Param]) -> None:
    live_shape = [(n, k, d is not NO_DEFAULT) for n, k, d in live]
    stub_shape = [(n, k, d is not NO_DEFAULT) for n, k, d in stub]
    assert stub_shape == live_shape, (
        f"{where}: the stub's parameters (name, kind, has default) differ from the module's\n"
        f"  module: {live_shape}\n  stub:   {stub_shape}"
    )
    for (name, _, live_default), (_, _, stub_default) in zip(live, stub):
        if live_default is NO_DEFAULT or live_default == ("ellipsis", Ellipsis):
            continue
        assert stub_default == live_default, (
            f"{where}: parameter {name!r} defaults to {live_default[1]!r} in the module, "
            f"{stub_default[1]!r} in the stub"
        )


def _signature_cases() -> list[Any]:
    """A case ``(object, its stub function or None)`` for everything with a text signature."""
    cases = []
    for name, obj in sorted(vars(native).items()):
        if _dunder(name):
            continue
        node = STUB_TOP.get(name)
        if isinstance(obj, type):
            members = _defs(node.body) if isinstance(node, ast.ClassDef) else {}
            if obj.__text_signature__ is not None:
                cases.append(pytest.param(obj, members.get("__new__"), id=f"{name}.__new__"))
            for attr, value in sorted(vars(obj).items()):
                if _dunder(attr) or getattr(value, "__text_signature__", None) is None:
                    continue
                cases.append(pytest.param(value, members.get(attr), id=f"{name}.{attr}"))
        elif getattr(obj, "__text_signature__", None) is not None:
            cases.append(pytest.param(obj, node, id=name))
    return cases


# --- tests --------------------------------------------------------------------------------


def _class_pair(name: str) -> tuple[type, ast.ClassDef]:
    """The module's class `name` and the stub's."""
    node = STUB_CLASSES.get(name)
    assert node is not None, f"the stub has no class {name}"
    return MODULE_CLASSES[name], node


def test_stub_is_valid_python_syntax():
    # ``TREE`` is the stub parsed once, at import: a syntax error fails there, naming the line.
    assert isinstance(TREE, ast.Module)
    assert STUB_TOP, "the stub defines nothing"


def test_stub_top_level_names_match_module():
    live = {n for n in dir(native) if not _dunder(n)}
    stub = {n for n in STUB_TOP if not _dunder(n)}
    assert stub == live, (
        f"only in the module: {sorted(live - stub)}; only in the stub: {sorted(stub - live)}"
    )


@pytest.mark.parametrize("name", sorted(MODULE_CLASSES))
def test_stub_class_members_match_module(name):
    cls, node = _class_pair(name)
    live, stub = _module_members(cls), _stub_members(node)
    assert stub == live, (
        f"{name}: only in the module: {sorted(live - stub)}; "
        f"only in the stub: {sorted(stub - live)}"
    )


@pytest.mark.parametrize("name", sorted(MODULE_CLASSES))
def test_stub_properties_are_the_module_getters(name):
    cls, node = _class_pair(name)
    members = _defs(node.body)
    for attr, value in vars(cls).items():
        if _dunder(attr) or attr not in members:
            continue
        getter = inspect.isdatadescriptor(value)
        in_stub = members[attr]
        is_property = isinstance(in_stub, ast.AnnAssign) or "property" in _decorators(in_stub)
        assert is_property == getter, (
            f"{name}.{attr} is a {'getter' if getter else 'method'} in the module, "
            f"a {'property' if is_property else 'method'} in the stub"
        )


@pytest.mark.parametrize(("obj", "node"), _signature_cases())
def test_stub_signature_matches_text_signature(obj, node):
    label = getattr(obj, "__qualname__", repr(obj))
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), (
        f"{label}: the stub has no function for it"
    )
    _compare(label, _text_params(obj.__text_signature__), _params(node.args))


@pytest.mark.parametrize("name", sorted(MODULE_CLASSES))
def test_stub_class_bases_match_module(name):
    """Exception classes (and the others, whose base is ``object``) subclass what they do."""
    cls, node = _class_pair(name)
    live = [b.__name__ for b in cls.__bases__ if b is not object]
    stub = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
    assert stub == live, f"{name}: bases {live} in the module, {stub} in the stub"


@pytest.mark.parametrize("name", sorted(MODULE_CLASSES))
def test_stub_final_marks_classes_that_cannot_be_subclassed(name):
    cls, node = _class_pair(name)
    final_live = not cls.__flags__ & BASETYPE
    final_stub = "final" in _decorators(node)
    assert final_stub == final_live, (
        f"{name}: {'cannot' if final_live else 'can'} be subclassed, "
        f"but the stub {'marks' if final_stub else 'does not mark'} it @final"
    )


def test_every_native_callable_has_a_text_signature():
    """Signatures are checked only where pyo3 records one: none may go unchecked."""
    missing = []
    for name, obj in vars(native).items():
        if _dunder(name):
            continue
        if isinstance(obj, type):
            if issubclass(obj, BaseException):
                continue
            if obj.__text_signature__ is None:
                missing.append(f"{name}.__new__")
            for attr, value in vars(obj).items():
                if callable(value) and not _dunder(attr):
                    if getattr(value, "__text_signature__", None) is None:
                        missing.append(f"{name}.{attr}")
        elif callable(obj) and getattr(obj, "__text_signature__", None) is None:
            missing.append(name)
    assert not missing, f"no __text_signature__ to check the stub against: {missing}"


def test_installed_package_ships_the_stub_and_its_marker() -> None:
    """The installed package carries this stub beside the module, and ``py.typed`` (PEP 561):
    a type checker in a user's environment finds them."""
    installed = Path(native.__file__).parent
    assert (installed / "py.typed").is_file(), f"no py.typed in {installed}"
    shipped = installed / "_native.pyi"
    assert shipped.is_file(), f"no _native.pyi in {installed}"
    assert shipped.read_bytes() == STUB.read_bytes(), f"{shipped} differs from {STUB}"
