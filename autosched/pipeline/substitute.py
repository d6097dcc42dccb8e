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


def substitute_workloads(mod: IRModule, model_layout: bool = False) -> IRModule:
    """Replace each ``R.nn.attention`` (layout [batch, seq, heads, dim], no bias, causal or not) by a call
    of our ``attention`` workload's kernel on [batch, heads, seq, dim]. The kernel keeps the workload in
    an attribute, so it is tuned and stored under the same key as ``autosched tune attention`` and gets
    the attention space (the fused FlashAttention template on the GPU) instead of generic fusion.

    With ``model_layout`` (sm_90), attention the Hopper space serves becomes ``attention_bshd`` on the
    layout as it is, and :func:`compose_permutes` then removes the transposes a model writes around it."""
    import tvm
    from tvm import relax

    from autosched.search_spaces.hopper_attention import serves

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
            shape, attrs = {"b": b, "h": h, "s": s, "d": d, "hkv": hkv}, {"causal": causal == "TopLeft"}
            if model_layout and serves(dtype, d):
                gv = self.builder_.add_func(workload_func(make_workload("attention_bshd", shape, dtype, attrs)),
                                            "autosched_attention")
                return relax.call_tir(gv, [q, k, v], relax.TensorType((b, s, h, d), dtype))
            gv = self.builder_.add_func(workload_func(make_workload("attention", shape, dtype, attrs)),
                                        "autosched_attention")
            qt, kt, vt = (self.builder_.emit(relax.op.permute_dims(x, [0, 2, 1, 3])) for x in (q, k, v))
            out = self.builder_.emit(relax.call_tir(gv, [qt, kt, vt], relax.TensorType((b, h, s, d), dtype)))
            return relax.op.permute_dims(out, [0, 2, 1, 3])

    return compose_permutes(_mutated(mod, Substitute))


def compose_permutes(mod: IRModule) -> IRModule:
    """A transpose of a transpose as one transpose, or none where they cancel, and a reshape of a reshape
    as one. A model's heads go [b,s,h,d] -> [b,h,s,d] for attention and back after it; where attention
    takes [b,s,h,d] itself, the pairs cancel (else each was a copy of the tensor, a kernel of its own), and
    the reshapes left around it become one, which the build makes a view (two, fused, were a copy)."""
    import tvm
    from tvm import relax

    permute, reshape = tvm.ir.Op.get("relax.permute_dims"), tvm.ir.Op.get("relax.reshape")

    def axes_of(call, rank: int) -> list[int]:
        axes = call.attrs.axes
        return list(range(rank))[::-1] if axes is None else [int(a) for a in axes]

    @relax.expr_functor.mutator
    class Compose(relax.PyExprMutator):
        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            op = call.op if isinstance(call.op, tvm.ir.Op) else None
            if op is None or not (op.same_as(permute) or op.same_as(reshape)):
                return call
            inner = call.args[0]
            bound = self.lookup_binding(inner) if isinstance(inner, relax.Var) else None
            if not (isinstance(bound, relax.Call) and isinstance(bound.op, tvm.ir.Op) and bound.op.same_as(op)):
                return call
            source = bound.args[0]
            if op.same_as(reshape):
                return relax.op.reshape(source, call.args[1])
            rank = len(source.ty.shape)
            first, second = axes_of(bound, rank), axes_of(call, rank)
            axes = [first[a] for a in second]
            return source if axes == list(range(rank)) else relax.op.permute_dims(source, axes)

    return relax.transform.DeadCodeElimination()(_mutated(mod, Compose))


def _mutated(mod: IRModule, mutator_class) -> IRModule:
    """``mod`` with every Relax function rewritten by ``mutator_class``."""
    from tvm import relax

    mutator = mutator_class(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()
