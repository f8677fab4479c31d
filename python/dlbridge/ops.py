"""Built-in kernels on dlbridge arrays, on whichever device the arrays live.

Every function takes dlbridge arrays, any DLPack array (imported without a copy: a PyTorch or
CuPy tensor works as it is), and — for the binary functions — Python numbers. Results are new
dlbridge arrays on the operands' device. On CUDA the work is enqueued on the current stream
(:func:`dlbridge.cuda.stream`) and the call returns without waiting.

Broadcasting follows NumPy. Type rules: arrays of one kind (signed, unsigned, floating) give the
wider type; an integer array with a floating one gives the floating type; Python numbers take the
array's type (an ``int`` array with a ``float`` gives ``float64``); ``div`` of integers and
``sqrt exp log sin cos`` of integers give floats as NumPy does; ``bool`` and complex arrays are
refused. ``float16`` and ``bfloat16`` are computed in ``float32``.

``floor_divide`` (``//``), ``remainder`` (``%``, alias ``mod``) and ``pow`` (``**``, alias
``power``) follow NumPy's rules: the floored quotient, and a remainder with the divisor's sign;
integers keep their type (an integer divided by zero gives 0, NumPy's value, without NumPy's
warning); integers to negative integer powers raise ``ValueError`` as in NumPy (on a GPU this
reads the exponents' minimum back, a wait for the device).

Reductions take ``axis`` (None, an int, a tuple; ``argmax`` / ``argmin`` one int) and
``keepdims``: ``sum mean max min prod`` (integer sums and products in 64 bits, wrapping as NumPy's),
``argmax argmin`` (``int64``; the first among equals, the first NaN if any), ``all any`` (``bool``;
NaN is true), ``var std`` (``ddof``; floats keep their dtype, integers give ``float64``). ``bool``
arrays reduce as NumPy's (``sum`` counts in ``int64``).

Comparisons (``equal not_equal less less_equal greater greater_equal``, and the operators
``== != < <= > >=`` of :class:`dlbridge.Array`) return ``bool`` arrays, compare ``bool`` arrays
too, and follow NumPy: NaN is unequal to everything, itself included; an integer outside the
array's dtype compares by its value (every ``int8`` is ``< 1000``).

>>> import dlbridge
>>> a = dlbridge.asarray([[1.0, 2.0], [3.0, 4.0]])
>>> dlbridge.ops.add(a, 1).tolist()
[[2.0, 3.0], [4.0, 5.0]]
>>> (a @ a).tolist()
[[7.0, 10.0], [15.0, 22.0]]
>>> a.sum(axis=0).tolist()
[4.0, 6.0]
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

from . import _dlbridge
from ._dlbridge import Array

Axis = Optional[Union[int, Tuple[int, ...]]]

__all__ = [
    "UNARY",
    "BINARY",
    "COMPARISONS",
    "CLASSIFICATIONS",
    "REDUCTIONS",
    "abs",
    "add",
    "all",
    "any",
    "argmax",
    "argmin",
    "cos",
    "div",
    "divide",
    "equal",
    "exp",
    "floor_divide",
    "greater",
    "greater_equal",
    "isfinite",
    "isinf",
    "isnan",
    "less",
    "less_equal",
    "log",
    "matmul",
    "max",
    "mean",
    "min",
    "mod",
    "mul",
    "multiply",
    "negative",
    "not_equal",
    "pow",
    "power",
    "prod",
    "ravel",
    "remainder",
    "sin",
    "sqrt",
    "square",
    "std",
    "sub",
    "subtract",
    "sum",
    "transpose",
    "var",
]

#: Element-wise functions of one operand.
UNARY = ("sqrt", "exp", "log", "sin", "cos", "abs", "square", "negative")
#: Element-wise functions of two operands.
BINARY = ("add", "sub", "mul", "div", "floor_divide", "remainder", "pow")
#: Element-wise classifications (``bool`` results; NumPy's ``isnan isinf isfinite``).
CLASSIFICATIONS = ("isnan", "isinf", "isfinite")
#: Element-wise comparisons (``bool`` results).
COMPARISONS = ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")
#: Reductions.
REDUCTIONS = ("sum", "mean", "max", "min", "prod", "argmax", "argmin", "all", "any", "var", "std")


def _unary(name: str) -> Callable[[Any], Array]:
    def op(x: Any) -> Array:
        return _dlbridge._unary(name, x)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``{name}(x)`` element-wise, on ``x``'s device."
    return op


def _binary(name: str) -> Callable[[Any, Any], Array]:
    def op(a: Any, b: Any) -> Array:
        return _dlbridge._binary(name, a, b)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``{name}(a, b)`` element-wise with NumPy broadcasting."
    return op


def _comparison(name: str, symbol: str) -> Callable[[Any, Any], Array]:
    def op(a: Any, b: Any) -> Array:
        return _dlbridge._compare(name, a, b)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = (
        f"``a {symbol} b`` element-wise with NumPy broadcasting, a ``bool`` array (NaN compares "
        "unequal to everything)."
    )
    return op


def _reduction(name: str) -> Callable[..., Array]:
    def op(x: Any, axis: Axis = None, keepdims: bool = False) -> Array:
        return _dlbridge._reduce(name, x, axis, keepdims)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = (
        f"The {name} over ``axis`` (None: every element; an int or a tuple of ints, negative "
        "counted from the end); ``keepdims`` keeps reduced axes with length 1."
    )
    return op


isnan = _unary("isnan")
isinf = _unary("isinf")
isfinite = _unary("isfinite")
sqrt = _unary("sqrt")
exp = _unary("exp")
log = _unary("log")
sin = _unary("sin")
cos = _unary("cos")
abs = _unary("abs")
square = _unary("square")
negative = _unary("negative")

add = _binary("add")
sub = _binary("sub")
mul = _binary("mul")
div = _binary("div")
subtract = sub
multiply = mul
divide = div

equal = _comparison("equal", "==")
not_equal = _comparison("not_equal", "!=")
less = _comparison("less", "<")
less_equal = _comparison("less_equal", "<=")
greater = _comparison("greater", ">")
greater_equal = _comparison("greater_equal", ">=")

floor_divide = _binary("floor_divide")
remainder = _binary("remainder")
pow = _binary("pow")
mod = remainder
power = pow

sum = _reduction("sum")
mean = _reduction("mean")
max = _reduction("max")
min = _reduction("min")
prod = _reduction("prod")
all = _reduction("all")
any = _reduction("any")


def argmax(x: Any, axis: Optional[int] = None, keepdims: bool = False) -> Array:
    """The index of the largest element along ``axis`` (None: of the flattened array), ``int64``;
    the first among equals, the first NaN if there is one (as NumPy)."""
    return _dlbridge._reduce("argmax", x, axis, keepdims)


def argmin(x: Any, axis: Optional[int] = None, keepdims: bool = False) -> Array:
    """The index of the smallest element along ``axis`` (None: of the flattened array), ``int64``;
    the first among equals, the first NaN if there is one (as NumPy)."""
    return _dlbridge._reduce("argmin", x, axis, keepdims)


def var(x: Any, axis: Axis = None, ddof: float = 0, keepdims: bool = False) -> Array:
    """The variance over ``axis``: the mean squared deviation, divided by ``n - ddof`` (``inf`` or
    NaN where that is 0 or less, as NumPy's values). Floats keep their dtype (computed in at least
    ``float32``); integers and ``bool`` give ``float64``."""
    return _dlbridge._reduce("var", x, axis, keepdims, ddof)


def std(x: Any, axis: Axis = None, ddof: float = 0, keepdims: bool = False) -> Array:
    """The standard deviation over ``axis``: the square root of :func:`var`."""
    return _dlbridge._reduce("std", x, axis, keepdims, ddof)


def transpose(x: Any, axes: Optional[Tuple[int, ...]] = None) -> Array:
    """``x`` with its axes permuted (reversed when ``axes`` is None), a view."""
    a = _dlbridge.asarray(x)
    return a.transpose() if axes is None else a.transpose(tuple(axes))


def ravel(x: Any) -> Array:
    """The elements of ``x`` in one axis, row-major: a view when the layout allows, else a copy."""
    return _dlbridge.asarray(x).ravel()


def matmul(a: Any, b: Any) -> Array:
    """The matrix product by NumPy's ``matmul`` rules (1-d operands, broadcast batch axes);
    floating dtypes only. cuBLAS on CUDA."""
    return _dlbridge._matmul(a, b)

