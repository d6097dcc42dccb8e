"""Workload substitution: our workloads' kernels in a Relax module, tagged with their workload so that
a kernel's task is the workload's; Relax's attention becomes a call of our attention kernel."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from autosched.workloads import Workload, get_operator, make_workload

if TYPE_CHECKING:
    from tvm import IRModule

# Deferred imports: tvm, numpy (imported where used: `autosched --help` stays fast).

WORKLOAD_ATTR = "autosched.workload"


def workload_func(wl):
    """Our kernel of ``wl`` for a ``call_tir``: tagged with its workload (so that the task is the
    workload's), opaque to fusion, and without the ``main`` symbol it is built under."""
    func = get_operator(wl.op).build(wl).with_attr(WORKLOAD_ATTR, json.dumps(wl.to_json()))
    # Opaque, so that fusion keeps our kernel whole. Built as a module's "main"; kept, that symbol
    # clashes with Relax's main in the GPU build, where unscheduled kernels keep their attributes.
    return func.with_attr("op_pattern", 8).without_attr("global_symbol")


def substitute_workloads(mod: IRModule, hopper: bool = False) -> IRModule:
    """Replace each ``R.nn.attention`` (layout [batch, seq, heads, dim], no bias, causal or not) by a call
    of our ``attention`` workload's kernel on [batch, heads, seq, dim]. The kernel keeps the workload in
    an attribute, so it is tuned and stored under the same key as ``autosched tune attention`` and gets
    the attention space (the fused FlashAttention template on the GPU) instead of generic fusion.

    With ``hopper`` (sm_90), attention the Hopper space serves becomes ``attention_bshd`` on the layout as
    it is, and :func:`compose_permutes` then removes the transposes a model writes around it; a SwiGLU
    MLP's gate and up projections become one ``swiglu_gemm`` (:func:`fuse_swiglu_gemms`)."""
    import tvm
    from tvm import relax

    from autosched.search_spaces.templates.hopper_attention import serves

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
            if hopper and serves(dtype, d):
                gv = self.builder_.add_func(workload_func(make_workload("attention_bshd", shape, dtype, attrs)),
                                            "autosched_attention")
                return relax.call_tir(gv, [q, k, v], relax.TensorType((b, s, h, d), dtype))
            gv = self.builder_.add_func(workload_func(make_workload("attention", shape, dtype, attrs)),
                                        "autosched_attention")
            qt, kt, vt = (self.builder_.emit(relax.op.permute_dims(x, [0, 2, 1, 3])) for x in (q, k, v))
            out = self.builder_.emit(relax.call_tir(gv, [qt, kt, vt], relax.TensorType((b, h, s, d), dtype)))
            return relax.op.permute_dims(out, [0, 2, 1, 3])

    mod = _mutated(mod, Substitute)
    return compose_permutes(fuse_swiglu_gemms(mod) if hopper else mod)


def fuse_swiglu_gemms(mod: IRModule) -> IRModule:
    """``SiLU(x·Wgᵀ) ⊙ (x·Wuᵀ)`` of two ``gemm`` kernels (as torch writes SiLU in half precision: in float32,
    cast back) as one ``swiglu_gemm`` on the two weights stacked (at build time), where its sm_90 space
    serves the shape: more rows than a decode step's (those GEMMs swap their operands). Not bit-exact: the
    gate's product is not rounded to half precision before its SiLU, nor the SiLU before the product."""
    import tvm
    from tvm import relax

    from autosched.search_spaces.templates.hopper_gemm import HopperGemmSpace

    ops = {name: tvm.ir.Op.get(f"relax.{name}") for name in ("multiply", "astype", "sigmoid", "reshape", "call_tir")}

    def is_call(expr, name):
        return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.same_as(ops[name])

    @relax.expr_functor.mutator
    class Fuse(relax.PyExprMutator):
        def bound(self, expr):
            found = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
            return expr if found is None else found

        def unshaped(self, expr):  # through reshapes to what they reshape
            while is_call(self.bound(expr), "reshape"):
                expr = self.bound(expr).args[0]
            return expr

        def plain_gemm(self, expr):
            """(x, weight, workload) of a gemm kernel with no bias or activation that ``expr`` reshapes."""
            call = self.bound(self.unshaped(expr))
            if not is_call(call, "call_tir"):
                return None
            func = self.builder_.get()[call.args[0]]
            if func.attrs is None or WORKLOAD_ATTR not in func.attrs:
                return None
            wl = Workload.from_json(str(func.attrs[WORKLOAD_ATTR]))
            if wl.op != "gemm" or wl.attrs_dict != {"bias": False, "act": "none"}:
                return None
            x, weight = call.args[1].fields
            return x, weight, wl

        def silu_of_gemm(self, expr):
            """The gemm of ``g · sigmoid(g)`` (``g`` the gemm's output, maybe in float32, cast back)."""
            product = self.bound(expr)
            if is_call(product, "astype"):
                product = self.bound(product.args[0])
            if not is_call(product, "multiply"):
                return None
            a, b = product.args
            for g, sig in ((a, b), (b, a)):
                sig = self.bound(sig)
                if is_call(sig, "sigmoid") and sig.args[0].same_as(g):
                    source = self.bound(g)
                    return self.plain_gemm(source.args[0] if is_call(source, "astype") else g)
            return None

        def visit_call_(self, call):
            new = self.visit_expr_post_order(call)
            if not is_call(new, "multiply"):
                return new
            for gate_side, up_side in ((0, 1), (1, 0)):
                gate, up = self.silu_of_gemm(new.args[gate_side]), self.plain_gemm(new.args[up_side])
                if gate is None or up is None:
                    continue
                (xg, wg, g), (xu, wu, u) = gate, up
                shape = g.shape_dict
                if g.shape != u.shape or g.dtype != u.dtype or not self.unshaped(xg).same_as(self.unshaped(xu)) \
                        or shape["m"] <= HopperGemmSpace.SWAP_MAX_M \
                        or not HopperGemmSpace.serves(shape["m"], shape["k"], g.dtype) \
                        or str(call.ty.dtype) != g.dtype:
                    continue
                fused = make_workload("swiglu_gemm", shape, g.dtype)
                gv = self.builder_.add_func(workload_func(fused), "autosched_swiglu_gemm")
                weights = self.builder_.emit(relax.op.concat([wg, wu], axis=0))
                out = self.builder_.emit(relax.call_tir(gv, [xg, weights],
                                                        relax.TensorType((shape["m"], shape["n"]), g.dtype)))
                return relax.op.reshape(out, call.ty.shape)
            return new

    return relax.transform.DeadCodeElimination()(_mutated(mod, Fuse))


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
            if op.same_as(reshape):  # to the source's own shape: no reshape at all
                same = [int(x) for x in source.ty.shape] == [int(x) for x in call.args[1].values]
                return source if same else relax.op.reshape(source, call.args[1])
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
