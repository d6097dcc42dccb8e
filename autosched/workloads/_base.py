"""The operator registry: what a workload is and how an operator describes itself.

A :class:`Workload` is plain data (operator name, shape, dtype, attributes) and is the key under which
tuning records are stored. An :class:`Operator` turns a workload into a TensorIR function (through TE),
random inputs, and a reference result computed by torch in float64.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..correctness import relative_error
from ..errors import UsageError

if TYPE_CHECKING:
    import torch
    from tvm.tirx import PrimFunc

# Deferred imports: torch (imported where used: `autosched --help` stays fast).

DTYPES = ("float32", "float16", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "fp16": "float16", "f16": "float16", "half": "float16",
                 "bf16": "bfloat16", "float": "float32"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int32": 4}

# Relative L2 error ||out - ref|| / ||ref|| a correct kernel stays under, by output dtype. The outputs
# are rounded to the dtype, so the bound is a few units of its precision (METHOD.md's ranges).
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


@dataclass(frozen=True, order=True)
class Workload:
    """One operator at one shape, dtype and attribute set: the unit that is tuned and stored."""

    op: str
    shape: tuple[tuple[str, int], ...]
    dtype: str
    attrs: tuple[tuple[str, Any], ...] = ()

    @property
    def shape_dict(self) -> dict[str, int]:
        return dict(self.shape)

    @property
    def attrs_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def key(self) -> str:
        """A canonical, human-readable key, e.g. ``gemm[m=64,n=64,k=64]:float32``."""
        shape = ",".join(f"{k}={v}" for k, v in self.shape)
        attrs = "".join(f";{k}={v}" for k, v in self.attrs)
        return f"{self.op}[{shape}]:{self.dtype}{attrs}"

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "shape": dict(self.shape), "dtype": self.dtype, "attrs": dict(self.attrs)}

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> Workload:
        if isinstance(data, str):
            data = json.loads(data)
        return get_operator(data["op"]).workload(data["shape"], data["dtype"], data.get("attrs") or {})

    def __str__(self) -> str:
        return self.key


@dataclass(frozen=True)
class Preset:
    """A named shape taken from a real model layer."""

    name: str
    shape: dict[str, int]
    attrs: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class Attr:
    """A non-shape parameter of an operator with its allowed values (the first is the default). ``open``: any
    positive whole number is allowed too, the choices being the usual ones (a quantisation group of a whole row).
    ``unkeyed_default``: at its default the attribute is left out of the workload, so that one added to an
    operator later keeps the keys and records of the workloads that existed before it."""

    name: str
    choices: tuple[Any, ...]
    doc: str = ""
    open: bool = False
    unkeyed_default: bool = False

    @property
    def default(self) -> Any:
        return self.choices[0]


class Operator:
    """Base class of the operators; one subclass per operator, registered with :func:`register`.

    Subclasses set the class attributes and implement :meth:`build`, :meth:`make_inputs`,
    :meth:`reference`, :meth:`flops` and :meth:`min_bytes`. Inputs and outputs follow the order of the
    PrimFunc's parameters: inputs first, then outputs.
    """

    name: str = ""
    description: str = ""
    shape_keys: tuple[str, ...] = ()
    defaults: dict[str, int] = {}
    dtypes: tuple[str, ...] = DTYPES
    attrs: tuple[Attr, ...] = ()
    presets: tuple[Preset, ...] = ()
    # The schedule-space family that fits this operator's structure (see autosched.search_spaces).
    family: str = ""

    # ---- workload construction and validation -------------------------------------------------
    def workload(self, shape: dict[str, int] | None = None, dtype: str = "float32",
                 attrs: dict[str, Any] | None = None) -> Workload:
        """Validate and normalise user input into a :class:`Workload`; missing keys take defaults."""
        shape = dict(shape or {})
        unknown = sorted(set(shape) - set(self.shape_keys))
        if unknown:
            raise UsageError(f"{self.name} has no shape key {', '.join(unknown)}; "
                             f"its keys are {','.join(self.shape_keys)}")
        full = {}
        for key in self.shape_keys:
            value = shape.get(key, self.defaults.get(key))
            if value is None:
                raise UsageError(f"{self.name} needs shape key '{key}' (keys: {','.join(self.shape_keys)})")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"shape key {key}={value!r} of {self.name} must be a positive integer")
            full[key] = value
        dtype = normalize_dtype(dtype)
        if dtype not in self.dtypes:
            raise UsageError(f"{self.name} does not support dtype {dtype}; supported: {', '.join(self.dtypes)}")
        attrs = dict(attrs or {})
        known = {a.name: a for a in self.attrs}
        unknown = sorted(set(attrs) - set(known))
        if unknown:
            names = ", ".join(known) or "none"
            raise UsageError(f"{self.name} has no attribute {', '.join(unknown)} (attributes: {names})")
        norm = []
        for a in self.attrs:
            value = _coerce_attr(attrs.get(a.name, a.default), a)
            if not (a.unkeyed_default and value == a.default):
                norm.append((a.name, value))
        self.check(full, dtype, dict(norm))
        return Workload(self.name, tuple(full.items()), dtype, tuple(norm))

    def check(self, shape: dict[str, int], dtype: str, attrs: dict[str, Any]) -> None:
        """Operator-specific validation beyond the generic checks; raise :class:`UsageError`."""

    def preset(self, name: str) -> Preset:
        for p in self.presets:
            if p.name == name:
                return p
        names = ", ".join(p.name for p in self.presets) or "none"
        raise UsageError(f"{self.name} has no preset '{name}' (presets: {names})")

    # ---- what subclasses implement -------------------------------------------------------------
    def build(self, wl: Workload) -> PrimFunc:
        raise NotImplementedError

    def make_inputs(self, wl: Workload, gen: torch.Generator, device: str) -> list[torch.Tensor]:
        raise NotImplementedError

    def output_specs(self, wl: Workload) -> list[tuple[tuple[int, ...], str]]:
        raise NotImplementedError

    def reference(self, wl: Workload, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def flops(self, wl: Workload) -> float:
        raise NotImplementedError

    def min_bytes(self, wl: Workload) -> float:
        raise NotImplementedError

    def tolerance(self, wl: Workload) -> float:
        return TOLERANCE[wl.dtype]

    def errors(self, wl: Workload, inputs: list[torch.Tensor], outs: list[torch.Tensor],
               refs: list[torch.Tensor]) -> list[float]:
        """Each output's error against its reference, which a correct kernel keeps within :meth:`tolerance`: the
        relative L2 error (infinite where an output has NaN/inf). An operator whose outputs are not numbers to
        compare so (``fp8_quant_rows``' float8 codes) says what its errors are."""
        return [relative_error(o, r) for o, r in zip(outs, refs)]


_REGISTRY: dict[str, Operator] = {}


def register(cls: type[Operator]) -> type[Operator]:
    _REGISTRY[cls.name] = cls()
    return cls


def get_operator(name: str) -> Operator:
    op = _REGISTRY.get(name)
    if op is None:
        close = [n for n in _REGISTRY if n.startswith(name[:3])]
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UsageError(f"unknown operator '{name}'; known operators: {', '.join(sorted(_REGISTRY))}.{hint} "
                         "(`autosched ops` lists them with their shape keys)")
    return op


def list_operators() -> list[Operator]:
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


# ---- parsing user input -------------------------------------------------------------------------
_SHAPE_ITEM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\S+?)\s*$")


def parse_assignments(text: str, what: str = "shape") -> dict[str, str]:
    """Parse ``m=2048,n=4096`` into ``{"m": "2048", "n": "4096"}`` (values left as strings)."""
    out: dict[str, str] = {}
    if not text or not text.strip():
        return out
    for item in text.split(","):
        match = _SHAPE_ITEM.match(item)
        if not match:
            raise UsageError(f"malformed {what} item '{item.strip()}' in '{text}': expected key=value pairs "
                             f"separated by commas, e.g. m=2048,n=4096,k=4096")
        key, value = match.groups()
        if key in out:
            raise UsageError(f"{what} key '{key}' given twice in '{text}'")
        out[key] = value
    return out


def parse_shape(text: str) -> dict[str, int]:
    shape = {}
    for key, value in parse_assignments(text).items():
        try:
            shape[key] = int(value)
        except ValueError:
            raise UsageError(f"shape value {key}={value} is not an integer (write e.g. {key}=1024 and separate "
                             "keys with commas: m=2048,n=4096)") from None
        if shape[key] < 1:
            raise UsageError(f"shape value {key}={value} must be a positive integer")
    return shape


def normalize_dtype(dtype: str) -> str:
    dtype = DTYPE_ALIASES.get(dtype.strip().lower(), dtype.strip().lower())
    if dtype not in DTYPES:
        raise UsageError(f"unsupported dtype '{dtype}'; supported: {', '.join(DTYPES)} (or fp32, fp16, bf16)")
    return dtype


def _coerce_attr(value: Any, attr: Attr) -> Any:
    """Turn a CLI string (or a JSON value) into one of the attribute's choices."""
    for choice in attr.choices:
        if value == choice or str(value).lower() == str(choice).lower():
            return choice
        if isinstance(choice, bool) and str(value).lower() in (("1", "true", "yes") if choice else ("0", "false", "no")):
            return choice
    if attr.open and not isinstance(value, bool) and str(value).isdigit() and int(value) > 0:
        return int(value)
    more = " or another positive whole number" if attr.open else ""
    raise UsageError(f"attribute {attr.name}={value} is not one of {', '.join(map(str, attr.choices))}{more}")


# ---- helpers shared by the operator definitions ---------------------------------------------------
def torch_dtype(dtype: str) -> torch.dtype:
    import torch

    # Every TVM dtype a kernel's buffer can have that torch also has (int64: a model's token ids).
    names = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
    if dtype not in names:
        raise ValueError(f"no torch dtype for TVM dtype {dtype!r} (supported: {', '.join(names)})")
    return getattr(torch, dtype)


def randn(shape: tuple[int, ...], dtype: str, gen: torch.Generator, device: str, scale: float = 1.0) -> torch.Tensor:
    """Normal random data drawn on the CPU (reproducible across devices), moved to ``device``."""
    import torch

    data = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    return data.to(torch_dtype(dtype)).to(device)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
