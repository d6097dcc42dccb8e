"""Workload substitution: our workloads' kernels in a Relax module, tagged with their workload so that
a kernel's task is the workload's; Relax's attention becomes a call of our attention kernel."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from autosched.workloads import get_operator, make_workload

if TYPE_CHECKING:
    from tvm import IRModule

WORKLOAD_ATTR = "autosched.workload"


def workload_func(wl):
    """Our kernel of ``wl`` for a ``call_tir``: tagged with its workload (so that the task is the
    workload's), opaque to fusion, and without the ``main`` symbol it is built under."""
    func = get_operator(wl.op).build(wl).with_attr(WORKLOAD_ATTR, json.dumps(wl.to_json()))
    # Opaque, so that fusion keeps our kernel whole. Built as a module's "main"; kept, that symbol
    # clashes with Relax's main in the GPU build, where unscheduled kernels keep their attributes.
    return func.with_attr("op_pattern", 8).without_attr("global_symbol")


def substitute_workloads(mod: IRModule) -> IRModule:
    """Replace each ``R.nn.attention`` (layout [batch, seq, heads, dim], no bias, causal or not) by a call
    of our ``attention`` workload's kernel on [batch, heads, seq, dim]. The kernel keeps the workload in
    an attribute, so it is tuned and stored under the same key as ``autosched tune attention`` and gets
    the attention space (the fused FlashAttention template on the GPU) instead of generic fusion."""
    import tvm
    from tvm import relax

    attention = tvm.ir.Op.get("relax.nn.attention")

    @relax.expr_functor.mutator
    class Substitute(relax.PyExprMutator):
        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.same_as(attention) and len(call.args) == 3):
                return call
            attrs = call.attrs
            causal = str(attrs.causal_mask or "")
            if attrs.scale is not None or attrs.window_size is not None or causal not in ("", "TopLeft"):
                return call
            q, k, v = call.args
            b, s, h, d = (int(x) for x in q.ty.shape)
            hkv, dtype = int(k.ty.shape[2]), str(q.ty.dtype)
            if int(k.ty.shape[1]) != s:
                return call  # cross attention: not our workload
            wl = make_workload("attention", {"b": b, "h": h, "s": s, "d": d, "hkv": hkv}, dtype,
                               {"causal": causal == "TopLeft"})
            gv = self.builder_.add_func(workload_func(wl), "autosched_attention")
            qt, kt, vt = (self.builder_.emit(relax.op.permute_dims(x, [0, 2, 1, 3])) for x in (q, k, v))
            out = self.builder_.emit(relax.call_tir(gv, [qt, kt, vt], relax.TensorType((b, h, s, d), dtype)))
            return relax.op.permute_dims(out, [0, 2, 1, 3])

    mutator = Substitute(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()
