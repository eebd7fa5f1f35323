"""Every public name of singd_cuda has a docstring, so the API reference is complete.

Public: the names in ``singd_cuda.__all__`` and in the ``__all__`` of its subpackages and
modules, and the public methods and properties those classes define (inherited docstrings
count, as ``inspect.getdoc`` and the API pages read them). A constant is documented by the
string literal right after its assignment.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import pkgutil
from pathlib import Path
from types import ModuleType

import pytest

import singd_cuda


def _public_modules() -> list[ModuleType]:
    modules = [singd_cuda]
    for info in pkgutil.iter_modules(singd_cuda.__path__):
        module = importlib.import_module(f"singd_cuda.{info.name}")
        if hasattr(module, "__all__"):
            modules.append(module)
    return modules


def _exports() -> list[tuple[str, object]]:
    return [
        (f"{module.__name__}.{name}", getattr(module, name))
        for module in _public_modules()
        for name in module.__all__
    ]


def _constant_documented(qualname: str) -> bool:
    """True when a module of the package assigns the name at module level and follows the
    assignment with a string literal (an attribute docstring, as griffe reads it). The
    sources are parsed, not imported (importing ``__main__`` modules would run them)."""
    name = qualname.rsplit(".", 1)[1]
    for path in sorted(Path(singd_cuda.__file__).parent.rglob("*.py")):
        body = ast.parse(path.read_text()).body
        for statement, following in itertools.pairwise(body):
            if isinstance(statement, ast.Assign):
                targets = statement.targets
            elif isinstance(statement, ast.AnnAssign):
                targets = [statement.target]
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return (
                    isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)
                    and bool(following.value.value.strip())
                )
    return False


EXPORTS = _exports()


@pytest.mark.parametrize(("qualname", "obj"), EXPORTS, ids=[q for q, _ in EXPORTS])
def test_public_name_has_a_docstring(qualname, obj):
    if inspect.ismodule(obj):
        assert (obj.__doc__ or "").strip(), f"module {qualname} has no docstring"
    elif inspect.isclass(obj) or callable(obj):
        assert inspect.getdoc(obj), f"{qualname} has no docstring"
    else:
        assert _constant_documented(qualname), (
            f"constant {qualname}: put a string literal right after its assignment"
        )


def _public_members() -> list[tuple[str, object]]:
    members = {}
    for _, cls in EXPORTS:
        if not inspect.isclass(cls):
            continue
        for attr in dir(cls):
            if attr.startswith("_"):
                continue
            owner = next(c for c in cls.__mro__ if attr in vars(c))
            if not owner.__module__.startswith("singd_cuda"):
                continue  # torch.optim.Optimizer's own methods
            static = inspect.getattr_static(cls, attr)
            if isinstance(static, staticmethod | classmethod | property) or inspect.isfunction(
                static
            ):
                members[f"{owner.__module__}.{owner.__qualname__}.{attr}"] = getattr(cls, attr)
    return sorted(members.items())


MEMBERS = _public_members()


@pytest.mark.parametrize(("qualname", "member"), MEMBERS, ids=[q for q, _ in MEMBERS])
def test_public_member_has_a_docstring(qualname, member):
    assert inspect.getdoc(member), f"{qualname} has no docstring"


def test_the_check_sees_the_optimizers():
    names = {q for q, _ in EXPORTS}
    assert {
        "singd_cuda.SINGD",
        "singd_cuda.structures.Dense",
        "singd_cuda.ops.sgd_epilogue_",
    } <= names
    assert any(q.endswith("KroneckerOptimizer.step") for q, _ in MEMBERS)


@pytest.mark.parametrize("optimizer", [singd_cuda.SINGD, singd_cuda.AdaFisher, singd_cuda.KFAC])
def test_every_constructor_argument_is_documented(optimizer):
    """Each argument of an optimizer's constructor has its entry (``name:``) in the class
    docstring, which the optimizer's API page renders."""
    doc = inspect.getdoc(optimizer)
    parameters = list(inspect.signature(optimizer.__init__).parameters.values())[1:]  # self
    entries = f"\n{doc}".replace("\n    ", "\n")
    names = [("**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in parameters]
    missing = [name for name in names if f"\n{name}:" not in entries]
    assert not missing, f"{optimizer.__name__} documents no {missing}"
