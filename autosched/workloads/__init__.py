"""The LLM operators autosched tunes: TensorIR definitions, references, FLOP and byte counts."""

from ..errors import UsageError

# Every operator module, for its registrations: this package runs before any of its modules, so the registry is
# whole before anything asks it (``get_operator``), whichever module was imported.
from . import attention, dequant, fp8, gemm, moe, norm, rope  # noqa: F401  (registration side effects)
from ._base import (
    DTYPES,
    Attr,
    Operator,
    Preset,
    Workload,
    get_operator,
    list_operators,
    normalize_dtype,
    parse_assignments,
    parse_shape,
    torch_dtype,
)

__all__ = [
    "DTYPES",
    "Attr",
    "Operator",
    "Preset",
    "Workload",
    "get_operator",
    "list_operators",
    "make_workload",
    "supported_workload",
    "normalize_dtype",
    "parse_assignments",
    "parse_shape",
    "torch_dtype",
]


def make_workload(op: str, shape: str | dict[str, int] | None = None, dtype: str = "float32",
                  attrs: str | dict | None = None, preset: str | None = None) -> Workload:
    """Build a workload from user-facing input (strings as on the command line, or dicts).

    Args:
        op: operator name, e.g. ``"gemm"``.
        shape: ``"m=2048,n=4096,k=4096"`` or a dict; keys not given come from ``preset`` or defaults.
        dtype: input dtype (``float32``, ``float16``, ``bfloat16`` or their short names).
        attrs: ``"act=gelu,bias=1"`` or a dict of operator attributes.
        preset: name of a real-model layer preset of this operator (``autosched ops`` lists them).
    """
    operator = get_operator(op)
    full: dict[str, int] = {}
    full_attrs: dict = {}
    if preset:
        p = operator.preset(preset)
        full.update(p.shape)
        full_attrs.update(p.attrs)
    full.update(parse_shape(shape) if isinstance(shape, str) else (shape or {}))
    full_attrs.update(parse_assignments(attrs, "attribute") if isinstance(attrs, str) else (attrs or {}))
    return operator.workload(full, dtype, full_attrs)


def supported_workload(op: str, shape: dict[str, int], dtype: str, attrs: dict | None = None) -> Workload | None:
    """The workload, or None where the operator does not take this shape, dtype or attribute value (the
    caller keeps TVM's own operator there)."""
    try:
        return make_workload(op, shape, dtype, attrs)
    except UsageError:
        return None
