"""The element types the stub lists (python/dlbridge/_dlbridge.pyi) against the ones the built
module has: the module makes one attribute per dtype of the core's `DType::named` (the one list
of them), so a dtype added to the core and not to the stub fails here, and so does a stub entry
the core does not have.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dlbridge
from dlbridge import _dlbridge

STUB = Path(__file__).resolve().parents[2] / "python" / "dlbridge" / "_dlbridge.pyi"


def stub_dtypes(text: str) -> tuple[list[str], list[str]]:
    """The stub's module-level `name: DType` declarations and its `__all__`, in order."""
    tree = ast.parse(text)
    declared: list[str] = []
    exported: list[str] = []
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(node.annotation, ast.Name)
            and node.annotation.id == "DType"
        ):
            declared.append(node.target.id)
        elif (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, (ast.List, ast.Tuple))
        ):
            exported = [ast.literal_eval(e) for e in node.value.elts]
    return declared, exported


def module_dtypes() -> list[str]:
    """The built module's dtype attributes, in the order the module added them."""
    return [name for name, value in vars(_dlbridge).items() if isinstance(value, _dlbridge.DType)]


def differences(text: str) -> list[str]:
    """What the stub `text` and the built module disagree on (empty when they agree)."""
    declared, exported = stub_dtypes(text)
    module = module_dtypes()
    problems = []
    missing = [n for n in module if n not in declared]
    extra = [n for n in declared if n not in module]
    if missing:
        problems.append(f"dtypes of the core the stub does not declare: {missing}")
    if extra:
        problems.append(f"dtypes the stub declares that the core does not have: {extra}")
    if declared != module and not (missing or extra):
        problems.append(f"the stub declares the dtypes in another order: {declared} != {module}")
    if exported != list(_dlbridge.__all__):
        problems.append(f"the stub's __all__ {exported} is not the module's {_dlbridge.__all__}")
    return problems


def test_the_stub_declares_exactly_the_cores_dtypes() -> None:
    assert differences(STUB.read_text()) == []


def test_every_dtype_is_a_package_attribute_and_round_trips() -> None:
    names = module_dtypes()
    assert "bool" in names and "float32" in names and "float4_e2m1fn" in names
    for name in names:
        dtype = getattr(dlbridge, name)
        assert isinstance(dtype, dlbridge.DType)
        assert dtype == name and dlbridge.DType(name) == dtype
    # `bool` stays out of `from dlbridge import *` (it would shadow the built-in).
    assert list(_dlbridge.__all__) == [n for n in names if n != "bool"]


def test_the_check_notices_a_dtype_missing_from_the_stub() -> None:
    """The comparison is not vacuous: a stub without one of the core's dtypes (what a dtype added
    to the core and forgotten in the stub looks like) is reported, and so is an extra one."""
    text = STUB.read_text()
    without = text.replace("\nfloat8_e5m2fnuz: DType\n", "\n", 1)
    assert without != text
    assert any("float8_e5m2fnuz" in p for p in differences(without))
    with_extra = text.replace("\nfloat32: DType\n", "\nfloat32: DType\nfloat128: DType\n", 1)
    assert any("float128" in p for p in differences(with_extra))
