"""The one place where a generation build chooses the attention kernels TVM's paged KV cache calls.

The decoder creates its cache with ``TIRPagedKVCache``, whose creation call (``create_paged_kv_cache``'s
``vm.builtin.paged_attention_kv_cache_create``) takes each attention kernel as ``(R.str("tirx"), kernel)``:
the runtime calls it as a TIR function of TVM's calling convention (``attn_backend.h``). Here a kernel of
ours with that convention takes a default kernel's place: its PrimFunc leaves the module, the tuple names
our kernel by its symbol (``R.ExternFunc``), and the kernel is compiled on its own (TIRx, sm_90a) and linked
into the executable, like the tuned TIRx kernels (``ApplyReport.separate``, ``compile_separate``). TVM's
default stays wherever ours does not serve the configuration, named as the fallback in the report.

Served so far, on sm_90, RoPE applied before caching (or none: ``rotary_mode`` 0), fp16/bf16:

* "decode over cached pages" (TVM's ``batch_decode_paged_kv``, without sliding window) by
  ``search_spaces/templates/kv_cache_decode.py``: head dims 32-256, pages of 16, GQA groups up to 8;
* "prefill over new tokens (ragged)" (TVM's ``batch_prefill_ragged_kv``: the runtime's causal attention of a
  prefill's new tokens to themselves, whose log-sum-exp it merges with that over the cached pages) by
  ``search_spaces/templates/kv_cache_prefill.py``: head dims 64 and 128, any GQA grouping;
* "prefill over cached pages" (TVM's ``batch_prefill_paged_kv``, without sliding window: a prefill chunk's or
  a speculative verify step's attention to the tokens cached before it) by the same template's paged kernel.

and, on sm_90, whatever the configuration (fp16/bf16/fp32), the cache's two elementwise kernels:

* "merge of partial attention" (TVM's ``tir_attention_merge_state``: a prefill chunk's or a verify step's
  attention over its new tokens merged with that over the cached pages) by ``templates/kv_cache_merge.py``;
* "rotary embedding and q/k/v split" (TVM's ``fused_rope``, every layer of every step) by
  ``templates/kv_cache_rope.py``, for the default and llama3 frequencies.

Both are plain TIR, so they stay in the module under our name (the cache's reference to TVM's PrimFunc now
names ours) and compile with the model's kernels, for both caches of a model with windowed layers.

Each role is a :class:`Role`: TVM's kernel by name, how to read the configuration off its buffers, and the
template module of ours; :func:`dispatch_attention` runs the same path for every role.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosched.target import device_facts
from autosched.tvm_adapter import FACTS_ATTR, MERGE_ARG, SPLIT_ROTARY_ARG, kv_cache_kernels, kv_cache_rope_modes

from .cpu_paged_prefill import KERNEL_ATTR

if TYPE_CHECKING:
    from tvm import IRModule

    from autosched.target import TargetSpec

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

DECODE_ROLE = "decode over cached pages"
RAGGED_PREFILL_ROLE = "prefill over new tokens (ragged)"
PAGED_PREFILL_ROLE = "prefill over cached pages"
MERGE_ROLE = "merge of partial attention"
ROPE_ROLE = "rotary embedding and q/k/v split"
TVM_DECODE = "batch_decode_paged_kv"  # TVM's kernels' symbols (and global names in our lowered module)
TVM_RAGGED_PREFILL = "batch_prefill_ragged_kv"
TVM_PAGED_PREFILL = "batch_prefill_paged_kv"
TVM_MERGE = "tir_attention_merge_state"  # ("..._cpu" on the CPU; in-module roles find it by position)
TVM_ROPE = "fused_rope"
# TVM's attention over speculative token trees, which the cache is given but generation never calls (its
# speculative steps are chains). With Llama 3's rotary scaling inlined, TVM's common-subexpression pass breaks
# batch_tree_attn ("variable cse_v21 has been used before definition"): on CUDA, with a scaled rotation, they
# compile apart without it (each kernel compiled apart costs a build a few seconds, so only then).
TVM_TREE_KERNELS = ("batch_tree_attn", "tree_attn_paged_kv")
TREE_ROLE = "attention over token trees (not called)"
NO_CSE = {"tirx.disable_cse_tir": True}
WINDOW_SUFFIX = "_window"  # a windowed second cache's kernels (the decoder adds them so: suffixed_functions)
ARCHS = ("sm_90", "sm_90a")
CODEGEN = {"tir_pipeline": "tirx", "arch": "sm_90a"}


@dataclass(frozen=True)
class Role:
    """One attention function the cache calls: ``tvm_kernel``, the name of TVM's PrimFunc for it; ``facts``,
    the configuration read off that PrimFunc's buffers (None if it is not the kernel we know); ``ours``, the
    template module of our kernel, whose ``unsupported(**facts)`` says why it cannot serve them (or None) and
    whose ``<kernel>(**facts)`` makes it (``<ours>_kernel`` unless named). ``in_module``: ours is plain TIR
    that takes the place of the PrimFunc each cache's creation call passes at ``cache_arg``, in the module,
    not a TIRx kernel compiled apart; it serves the CPU too (``gpu=False``), and as it does not attend, RoPE
    inside attention does not concern it."""

    name: str
    tvm_kernel: str
    ours: str
    facts: Callable[[Any], dict[str, Any] | None]
    kernel: str | None = None
    cache_arg: int | None = None  # in_module: where the cache's creation call passes TVM's kernel
    sms: bool = False  # ours is made for the GPU's multiprocessors (``sms=``, autosched.target.device_facts)

    @property
    def in_module(self) -> bool:
        return self.cache_arg is not None

    def module(self):
        return importlib.import_module(f"autosched.search_spaces.templates.{self.ours}")


def dispatch_attention(mod: IRModule, target: TargetSpec,
                       tree_apart: bool = False) -> tuple[IRModule, dict[str, str], dict[str, tuple]]:
    """(``mod`` with our kernels in the KV cache's place where they serve it, {role: what runs it} for the
    roles ours took or refused, {name: (kernel, pass options, codegen)} to compile on their own and link, as
    ``ApplyReport.separate`` holds them). ``mod``: a generation module as ``lower_generation`` gives it. A CPU
    build keeps TVM's CPU attention kernels (some under the GPU kernels' names) and takes our merge and
    split-and-rotate kernels, the GPU ones' bodies in loops. ``tree_apart``: TVM's tree-attention kernels
    compile apart without common-subexpression elimination (:data:`TVM_TREE_KERNELS`)."""
    served: dict[str, str] = {}
    kernels: dict[str, tuple] = {}
    for role in ROLES:
        if role.in_module:
            mod, served[role.name] = _swap_in_module(mod, role, target)
            continue
        if target.kind != "cuda":
            continue
        theirs = _function(mod, role.tvm_kernel)
        if theirs is None:
            continue
        reason, kernel = _ours(mod, role, theirs, target)
        if kernel is None:
            served[role.name] = f"TVM default ({role.tvm_kernel}): ours does not serve {reason}"
            continue
        name = str(kernel.attrs["global_symbol"])
        mod = _replace_in_cache(mod, role.tvm_kernel, name)
        kernels[name] = (kernel, {}, CODEGEN)
        others = sorted(gv.name_hint for gv in mod.functions if gv.name_hint.startswith(role.tvm_kernel))
        served[role.name] = f"autosched {role.ours} ({name})" + (
            f"; TVM default for the sliding-window variant ({', '.join(others)})" if others else "")
    apart = [name for name in TVM_TREE_KERNELS
             if tree_apart and target.kind == "cuda" and _function(mod, name) is not None]
    for name in apart:
        kernels[name] = (_function(mod, name).with_attr("global_symbol", name), NO_CSE, {})
        mod = _replace_in_cache(mod, name, name)
    if apart:
        served[TREE_ROLE] = f"TVM default ({', '.join(apart)}), compiled apart without common-subexpression elimination"
    return mod, served, kernels


def _function(mod: IRModule, name: str):
    for gv, func in mod.functions.items():
        if gv.name_hint == name:
            return func
    return None


def _paged_facts(func, params: int, q_at: int, pages_at: int) -> dict[str, Any] | None:
    """Heads, K/V heads, head dim, page size and dtype of a TVM kernel over the cache's pages, from its buffers
    (q [tokens, h, d] the ``q_at``-th of ``params`` parameters, pages [num_pages, 2, hkv, page, d] the
    ``pages_at``-th); None if it does not look like that kernel."""
    if len(func.params) != params:
        return None
    q, pages = func.params[q_at], func.params[pages_at]  # buffer parameters: their shapes and dtypes
    try:
        _, h, d = q.shape
        _, two, hkv, page, d2 = pages.shape
        facts = {"h": int(h), "hkv": int(hkv), "d": int(d), "dtype": str(q.dtype), "page": int(page)}
    except (AttributeError, ValueError, TypeError):
        return None
    if int(two) != 2 or int(d2) != facts["d"] or str(pages.dtype) != facts["dtype"]:
        return None
    return facts


def _decode_facts(func) -> dict[str, Any] | None:
    """TVM's decode kernel: (q [batch, h, d], pages, ...), 13 parameters."""
    return _paged_facts(func, 13, 0, 1)


def _ragged_prefill_facts(func) -> dict[str, Any] | None:
    """Heads, K/V heads, head dim and dtype of TVM's ragged prefill kernel, from its buffers (q [total_q,
    h, d], k and v [total_kv, hkv, d]); None if it does not look like that kernel (MLA's differing K and V
    head dims among them)."""
    params = list(func.params)
    if len(params) != 14:
        return None
    q, k, v = params[0], params[2], params[3]
    try:
        _, h, d = q.shape
        _, hkv, dk = k.shape
        _, hkv_v, dv = v.shape
        facts = {"h": int(h), "hkv": int(hkv), "d": int(d), "dtype": str(q.dtype)}
        same = (int(dk), int(dv), int(hkv_v)) == (facts["d"], facts["d"], facts["hkv"])
    except (AttributeError, ValueError, TypeError):
        return None
    if not same or str(k.dtype) != facts["dtype"] or str(v.dtype) != facts["dtype"]:
        return None
    return facts


def _paged_prefill_facts(func) -> dict[str, Any] | None:
    """TVM's paged prefill kernel: (q [total_q, h, d], q_indptr, pages, ...), 15 parameters."""
    return _paged_facts(func, 15, 0, 2)


def _attached_facts(func, params: int) -> dict[str, Any] | None:
    """What ``tir_paged_kv_cache`` attached to one of the cache's elementwise kernels (None: not there, or a
    kernel of another signature than ``params`` parameters)."""
    if func.attrs is None or FACTS_ATTR not in func.attrs or len(func.params) != params:
        return None
    return json.loads(str(func.attrs[FACTS_ATTR]))


def _merge_facts(func) -> dict[str, Any] | None:
    """TVM's merge kernel: (v [n, h, d], s [n, h] float32, v_other, s_other), its heads and head dim symbolic
    (its threads are laid out for the cache's)."""
    facts = _attached_facts(func, 4)
    return None if facts is None else facts | {"dtype": str(func.params[0].dtype)}


def _rope_facts(func) -> dict[str, Any] | None:
    """TVM's split-and-rotate kernel: (qkv [n, h + 2·hkv, d], position_map, q [n, h, d], k [n, hkv, d], v,
    apply_rope), and its rotary facts."""
    facts = _attached_facts(func, 6)
    if facts is None:
        return None
    qkv, _, q, k = func.params[:4]
    try:
        h, d = int(q.shape[1]), int(q.shape[2])
        hkv, fused = int(k.shape[1]), int(qkv.shape[1])
    except (AttributeError, ValueError, TypeError):
        return None
    if fused != h + 2 * hkv:
        return None
    return facts | {"h": h, "hkv": hkv, "d": d, "dtype": str(qkv.dtype)}


ROLES = (Role(RAGGED_PREFILL_ROLE, TVM_RAGGED_PREFILL, "kv_cache_prefill", _ragged_prefill_facts),
         Role(PAGED_PREFILL_ROLE, TVM_PAGED_PREFILL, "kv_cache_prefill", _paged_prefill_facts,
              "kv_cache_prefill_paged_kernel"),
         Role(DECODE_ROLE, TVM_DECODE, "kv_cache_decode", _decode_facts, sms=True),
         Role(MERGE_ROLE, TVM_MERGE, "kv_cache_merge", _merge_facts, cache_arg=MERGE_ARG),
         Role(ROPE_ROLE, TVM_ROPE, "kv_cache_rope", _rope_facts, cache_arg=SPLIT_ROTARY_ARG))


def _ours(mod: IRModule, role: Role, theirs, target: TargetSpec):
    """(why ours does not serve, None) or (None, our kernel) for ``role``, whose TVM kernel is ``theirs``."""
    if target.arch not in ARCHS and not role.in_module:
        return f"target {target.kind}:{target.arch} (sm_90 only)", None
    facts = role.facts(theirs)
    if facts is None:
        return f"a {role.tvm_kernel} of another signature", None
    modes = kv_cache_rope_modes(mod)
    if not role.in_module and (not modes or modes - {0, 1}):
        # RopeMode.INLINE (2) would have the kernel rotate Q and K itself (rotary_mode 1), which ours does not.
        return "RoPE applied inside attention (RopeMode.INLINE)", None
    ours = role.module()
    reason = ours.unsupported(**facts)
    if reason:
        return reason, None
    make = getattr(ours, role.kernel or f"{role.ours}_kernel")
    if role.in_module:
        return None, make(**facts, gpu=target.is_gpu)
    return None, make(**facts, **({"sms": device_facts(target).sms} if role.sms else {}))


def _replace_in_cache(mod: IRModule, old: str, new: str) -> IRModule:
    """``mod`` with the cache's ``(R.str("tirx"), old)`` tuples naming ``R.ExternFunc(new)`` instead, and the
    PrimFunc ``old`` removed."""
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class Swap(relax.PyExprMutator):
        def visit_tuple_(self, op):
            op = super().visit_tuple_(op)
            fields = list(op.fields)
            if (len(fields) == 2 and isinstance(fields[0], tvm.ir.StringImm) and fields[0].value == "tirx"
                    and isinstance(fields[1], tvm.ir.GlobalVar) and fields[1].name_hint == old):
                return relax.Tuple([fields[0], relax.ExternFunc(new)])
            return op

    out = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != old}, attrs=mod.attrs)
    for gv, func in list(out.functions.items()):
        if isinstance(func, relax.Function):
            out[gv] = Swap(out).visit_expr(func)
    return out


def _swap_in_module(mod: IRModule, role: Role, target: TargetSpec) -> tuple[IRModule, str]:
    """(``mod`` with our kernel in place of each cache's PrimFunc of ``role`` (on any target), what runs it)."""
    served = []
    for name in kv_cache_kernels(mod, role.cache_arg):
        reason, kernel = _ours(mod, role, _function(mod, name), target)
        if kernel is None:
            served.append(f"TVM default ({name}): ours does not serve {reason}")
            continue
        # one symbol per cache: the windowed cache's kernel may rotate at another theta
        symbol = str(kernel.attrs["global_symbol"]) + WINDOW_SUFFIX * name.endswith(WINDOW_SUFFIX)
        mod = _replace_function(mod, name, symbol, kernel.with_attr("global_symbol", symbol)
                                .with_attr(KERNEL_ATTR, role.ours))
        served.append(f"autosched {role.ours} ({symbol})")
    return mod, "; ".join(served) or "none"


def _replace_function(mod: IRModule, old: str, new: str, func) -> IRModule:
    """``mod`` with the PrimFunc ``old`` removed and ``func`` added as ``new``, every Relax reference to ``old``
    naming ``new``."""
    import tvm
    from tvm import relax

    builder = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != old},
                                              attrs=mod.attrs))
    new_var = builder.add_func(func, new)  # typed, as a Relax reference must be

    @relax.expr_functor.mutator
    class Swap(relax.PyExprMutator):
        def visit_global_var_(self, op):
            return new_var if op.name_hint == old else op

    out = builder.get()
    for gv, relax_func in list(out.functions.items()):
        if isinstance(relax_func, relax.Function):
            out[gv] = Swap(out).visit_expr(relax_func)
    return out
