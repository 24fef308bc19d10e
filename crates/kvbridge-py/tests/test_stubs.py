"""The type stubs (`kvbridge/_kvbridge.pyi`) describe the extension as it
is: every exported name, every public method and property of every class,
with the parameter names, order and defaults the runtime reports."""

import ast
import inspect
import os

import pytest

import kvbridge
from kvbridge import _kvbridge

STUB = os.path.join(os.path.dirname(kvbridge.__file__), "_kvbridge.pyi")


def stub_tree():
    with open(STUB) as f:
        return ast.parse(f.read())


def stub_classes():
    """name -> {member: ("method", [(param, default_source)]) | ("property", None)}."""
    out = {}
    for node in stub_tree().body:
        if not isinstance(node, ast.ClassDef):
            continue
        members = {}
        for item in node.body:
            if not isinstance(item, ast.FunctionDef):
                continue
            if any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                members[item.name] = ("property", None)
            else:
                members[item.name] = ("method", params_of(item.args))
        out[node.name] = members
    return out


def params_of(args):
    """[(name, default source or None)] without `self`, keyword-only marked."""
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + [
        ast.unparse(d) for d in args.defaults
    ]
    out = [(a.arg, d) for a, d in zip(positional, defaults) if a.arg != "self"]
    out += [
        ("*" + a.arg, None if d is None else ast.unparse(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults)
    ]
    return out


def runtime_params(obj):
    """The same list from pyo3's `__text_signature__`."""
    text = obj.__text_signature__.replace("$self", "self")
    tree = ast.parse(f"def f{text}: ...")
    return params_of(tree.body[0].args)


def stub_names():
    names = set()
    for node in stub_tree().body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_every_exported_name_has_a_stub():
    missing = sorted(set(kvbridge.__all__) - stub_names())
    assert not missing, f"no stub for {missing}"
    # And the package exports what the extension has.
    public = {n for n in dir(_kvbridge) if not n.startswith("_")} | {"__version__"}
    assert set(kvbridge.__all__) == public


def test_exceptions_have_their_runtime_bases():
    tree = {n.name: n for n in stub_tree().body if isinstance(n, ast.ClassDef)}
    for name in kvbridge.__all__:
        obj = getattr(kvbridge, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            bases = [ast.unparse(b) for b in tree[name].bases]
            assert bases == [obj.__base__.__name__], name


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in kvbridge.__all__
        if isinstance(getattr(kvbridge, n), type)
        and not issubclass(getattr(kvbridge, n), BaseException)
    ],
)
def test_class_stub_matches_the_runtime(name):
    cls = getattr(_kvbridge, name)
    stub = stub_classes()[name]
    runtime = {}
    for attr, value in vars(cls).items():
        if attr.startswith("_"):
            continue
        if inspect.isdatadescriptor(value):
            runtime[attr] = ("property", None)
        else:
            runtime[attr] = ("method", runtime_params(value))
    if cls.__text_signature__ is not None:
        runtime["__init__"] = ("method", runtime_params(cls))
    stub_public = {k: v for k, v in stub.items() if not k.startswith("_") or k == "__init__"}
    if cls.__text_signature__ is None:
        # Made by a manager, never by the caller.
        assert "__init__" not in stub_public, name
    assert stub_public == runtime, name
