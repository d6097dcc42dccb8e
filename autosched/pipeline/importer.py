"""Importing a PyTorch model into Relax, with the converters that substitute our workloads for
RMSNorm, attention and (on the GPU) Linear."""

from __future__ import annotations

import functools
import math
import warnings
from typing import TYPE_CHECKING

from autosched.tvm_adapter import convert_attention_as_tvm_does, convert_layer_norm_as_tvm_does
from autosched.workloads import supported_workload

from .graph_rewrites import CONSTANT_MASK, rewrite_exported, sdpa_arguments
from .substitute import substitute_workloads, workload_func

if TYPE_CHECKING:
    from tvm import IRModule

    from .load import Model

# Deferred imports: tvm, torch (imported where used: `autosched --help` stays fast).


def import_model(model: Model, *, linear_as_gemm: bool, hopper: bool = False) -> tuple[IRModule, list]:
    """The Relax module (weights as parameters after the inputs) and the weights.

    With ``linear_as_gemm``, each Linear's ``x @ W.T`` becomes our ``gemm`` kernel on W[n,k] as stored
    (on a GPU its spaces run a model's GEMMs several times faster than the generic ``matmul`` kernels);
    without it, the product stays a ``matmul`` on W transposed once at build time to [k,n], the layout
    the CPU space vectorises along (much faster there than W as stored).

    Every operator is decomposed as usual except scaled-dot-product attention, which reaches Relax as
    one ``R.nn.attention`` call so that :func:`substitute_workloads` can hand it to our attention kernel,
    and RMSNorm, which becomes a call of our ``rmsnorm`` kernel as it is imported. With ``hopper``
    (sm_90), attention reads and writes the heads as the Linears lay them out, and a SwiGLU MLP's gate and
    up projections are one GEMM (:func:`substitute_workloads`).
    """
    import torch
    from tvm.relax.frontend import detach_params
    from tvm.relax.frontend.torch import from_exported_program

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecations, not the user's
        exported = torch.export.export(model.module, model.inputs)
        table = torch.export.default_decompositions()
        for op in [op for op in table if "scaled_dot_product" in str(op) or "rms_norm" in str(op)]:
            del table[op]
        exported = exported.run_decompositions(table)
        rewrite_exported(exported)
        # Weights are the graph's parameters: a product with one may become our gemm.
        weights = frozenset(exported.graph_signature.inputs_to_parameters) if linear_as_gemm else None
        matmul = functools.partial(_matmul_in_torch_dtype, weights=weights)
        converters = {name: matmul for name in ("mm.default", "matmul.default", "bmm.default")}
        converters["addmm.default"] = functools.partial(_addmm_in_torch_dtype, weights=weights)
        converters["rms_norm.default"] = _rms_norm_as_workload
        converters["native_layer_norm.default"] = _layer_norm_bfloat16_in_float32
        converters["scaled_dot_product_attention.default"] = _attention
        mod = from_exported_program(exported, keep_params_as_input=True, unwrap_unit_return_tuple=True,
                                    run_ep_decomposition=False, custom_convert_map=converters)
    mod, params = detach_params(mod)
    return substitute_workloads(mod, hopper), list(params["main"])


def _matmul_in_torch_dtype(node, importer, weights: frozenset[str] | None):
    """``mm``/``matmul``/``bmm`` accumulated in float32 and returned in torch's dtype; given ``weights`` (the
    names of the graph's parameters), a Linear's ``x @ W.T`` becomes a call of our ``gemm`` workload's kernel.

    TVM 0.27's importer gives every such product a float32 result, so in a half-precision model all that
    follows (attention, the next GEMM's weights, the residual stream) silently ran in float32: twice the
    bytes and no tensor cores. The cast back fuses into the GEMM's kernel as its epilogue.
    """
    from tvm import relax

    lhs, rhs = importer.retrieve_args(node)
    dtype = str(node.meta["val"].dtype).replace("torch.", "")
    bb = importer.block_builder
    weight, stored_kn = _gemm_weight(node, importer, weights) if weights is not None else (None, False)
    if weight is not None and len(lhs.ty.shape) == 2 and str(lhs.ty.dtype) == str(weight.ty.dtype) == dtype:
        (m, k), n = (int(d) for d in lhs.ty.shape), int(weight.ty.shape[1 if stored_kn else 0])
        wl = supported_workload("gemm", {"m": m, "n": n, "k": k}, dtype)
        if wl is not None:
            gv = bb.add_func(workload_func(wl), "autosched_gemm")
            weight = _as_nk(bb, weight, stored_kn)
            return bb.emit(relax.call_tir(gv, [lhs, weight], relax.TensorType((m, n), dtype)))
    product = bb.emit(relax.op.matmul(lhs, rhs, out_dtype="float32"))
    if dtype in ("float16", "bfloat16"):
        return bb.emit(relax.op.astype(product, dtype))
    return product


def _addmm_in_torch_dtype(node, importer, weights: frozenset[str] | None):
    """``addmm(bias, x, W.T)``, a Linear with a bias as torch.export decomposes it: accumulated in float32,
    the bias added, and returned in torch's dtype. Given ``weights`` (as for ``mm``), a call of our ``gemm``
    workload's kernel with ``bias=True``, whose epilogue adds the bias.

    TVM 0.27's importer adds the model's (half-precision) bias to its float32 product: an import failure
    ("Binary operators must have the same datatype") for every half-precision model with biased Linears.
    """
    from tvm import relax

    bias, lhs, rhs = importer.retrieve_args(node)[:3]
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    dtype = str(node.meta["val"].dtype).replace("torch.", "")
    bb = importer.block_builder
    weight, stored_kn = _gemm_weight(node, importer, weights, factor=2) if weights is not None else (None, False)
    if (weight is not None and beta == 1 and alpha == 1 and len(lhs.ty.shape) == 2 and len(bias.ty.shape) == 1
            and str(lhs.ty.dtype) == str(weight.ty.dtype) == str(bias.ty.dtype) == dtype
            and int(bias.ty.shape[0]) == int(weight.ty.shape[1 if stored_kn else 0])):
        (m, k), n = (int(d) for d in lhs.ty.shape), int(bias.ty.shape[0])
        wl = supported_workload("gemm", {"m": m, "n": n, "k": k}, dtype, {"bias": True})
        if wl is not None:
            gv = bb.add_func(workload_func(wl), "autosched_gemm")
            weight = _as_nk(bb, weight, stored_kn)
            return bb.emit(relax.call_tir(gv, [lhs, weight, bias], relax.TensorType((m, n), dtype)))
    product = bb.emit(relax.op.matmul(lhs, rhs, out_dtype="float32"))
    if alpha != 1:
        product = bb.emit(relax.op.multiply(product, relax.const(alpha, "float32")))
    bias32 = bb.emit(relax.op.astype(bias, "float32"))
    if beta != 1:
        bias32 = bb.emit(relax.op.multiply(bias32, relax.const(beta, "float32")))
    out = bb.emit(relax.op.add(product, bias32))
    return bb.emit(relax.op.astype(out, dtype)) if dtype != "float32" else out


def _gemm_weight(node, importer, weights: frozenset[str], factor: int = 1):
    """(the Relax variable of the weight, whether it is stored W[k,n]) if argument ``factor`` of ``node`` is
    a weight: a Linear's ``permute(W, [1, 0])`` (W[n,k], our gemm's layout as stored), or a parameter (one
    of ``weights``) used as it is (``x @ W``, W[k,n]: GPT-2's Conv1D); (None, False) otherwise."""
    arg = node.args[factor]
    if getattr(arg, "target", None) is not None and "permute" in str(arg.target):
        weight = importer.env.get(arg.args[0])
        if list(arg.args[1]) == [1, 0] and weight is not None and len(weight.ty.shape) == 2:
            return weight, False
        return None, False
    if getattr(arg, "op", None) == "placeholder" and arg.name in weights:
        weight = importer.env.get(arg)
        if weight is not None and len(weight.ty.shape) == 2:
            return weight, True
    return None, False


def _as_nk(bb, weight, stored_kn: bool):
    """W[n,k] for our gemm: a weight stored W[k,n] is transposed, weight-only work that LiftTransformParams
    moves to build time."""
    from tvm import relax

    return bb.emit(relax.op.permute_dims(weight, [1, 0])) if stored_kn else weight


def _rms_norm_as_workload(node, importer):
    """``aten.rms_norm`` over the last axis: a call of our ``rmsnorm`` workload's kernel on the rows.

    Decomposed, it fused into three kernels (cast, square, and the rest) with float32 temporaries in
    between; one pass over the rows reads each element once. Other forms (no weight, several normalised
    axes, an eps the workload does not take) are decomposed here in Relax ops, computed in float32.
    """
    from tvm import relax

    args = list(importer.retrieve_args(node)) + [None, None]
    x, normalized, weight, eps = args[:4]
    dims, dtype = [int(d) for d in x.ty.shape], str(x.ty.dtype)
    rows, n = math.prod(dims[:-1]), dims[-1]
    bb = importer.block_builder
    wl = None
    if weight is not None and list(normalized) == [n] and str(weight.ty.dtype) == dtype:
        wl = supported_workload("rmsnorm", {"m": rows, "n": n}, dtype, {"eps": eps})
    if wl is None:
        import torch

        axes = list(range(len(dims) - len(normalized), len(dims)))
        eps = eps if eps is not None else float(torch.finfo(node.meta["val"].dtype).eps)  # torch's default
        x32 = bb.emit(relax.op.astype(x, "float32"))
        mean_square = bb.emit(relax.op.mean(bb.emit(relax.op.multiply(x32, x32)), axis=axes, keepdims=True))
        y = bb.emit(relax.op.multiply(x32, bb.emit(relax.op.rsqrt(bb.emit(
            relax.op.add(mean_square, relax.const(eps, "float32")))))))
        if weight is not None:
            y = bb.emit(relax.op.multiply(y, bb.emit(relax.op.astype(weight, "float32"))))
        return bb.emit(relax.op.astype(y, dtype))
    gv = bb.add_func(workload_func(wl), "autosched_rmsnorm")
    flat = bb.emit(relax.op.reshape(x, [rows, n]))
    out = bb.emit(relax.call_tir(gv, [flat, weight], relax.TensorType((rows, n), dtype)))
    return bb.emit(relax.op.reshape(out, dims))


def _layer_norm_bfloat16_in_float32(node, importer):
    """``native_layer_norm`` as TVM converts it, computed in float32 for a bfloat16 input: Relax's
    ``layer_norm`` takes float32 and float16 only (a bfloat16 GPT-2 failed to import)."""
    import torch
    from tvm import relax

    if str(importer.env[node.args[0]].ty.dtype) != "bfloat16":
        return convert_layer_norm_as_tvm_does(importer, node)
    # input, weight and bias (args 0, 2 and 3) are cast while TVM's converter reads them
    tensors = [a for i, a in enumerate(node.args) if i in (0, 2, 3) and isinstance(a, torch.fx.Node)]
    bb, saved = importer.block_builder, {a: importer.env[a] for a in tensors}
    try:
        for a in tensors:
            importer.env[a] = bb.emit(relax.op.astype(saved[a], "float32"))
        y = convert_layer_norm_as_tvm_does(importer, node)
    finally:
        importer.env.update(saved)
    return bb.emit(relax.op.astype(y, "bfloat16"))


# ---- attention as model authors write it ------------------------------------------------------------
def _attention(node, importer):
    """``scaled_dot_product_attention`` on [batch, heads, seq, dim] as ``R.nn.attention`` (which
    :func:`~autosched.pipeline.substitute.substitute_workloads` hands to our kernel), taking what models
    pass and TVM 0.27's converter refuses or drops: a boolean mask (True = attend) becomes an additive one
    (a constant one, computed at import by :mod:`.graph_rewrites`, is a constant here), a ``scale`` other
    than 1/sqrt(dim) is applied to the query, and ``enable_gqa``'s fewer key/value heads stay as they are
    for our kernel (its grouped-query form) or are repeated for a masked attention."""
    import torch
    from tvm import relax

    bb = importer.block_builder
    args = sdpa_arguments(node)
    q, k, v = (importer.env[args[name]] for name in ("query", "key", "value"))
    mask, dropout, causal, scale = args["attn_mask"], args["dropout_p"], args["is_causal"], args.get("scale")
    if len(q.ty.shape) != 4 or dropout:
        warnings.warn(f"attention on {len(q.ty.shape)}-D tensors or with dropout {dropout}: TVM's own converter "
                      "takes it, not our attention kernel", stacklevel=1)
        return convert_attention_as_tvm_does(importer, node)
    dtype, dim = str(q.ty.dtype), int(q.ty.shape[-1])
    if scale is not None and not math.isclose(scale, 1 / math.sqrt(dim), rel_tol=1e-6):
        q = bb.emit(relax.op.multiply(q, relax.const(scale * math.sqrt(dim), dtype)))
    bias, constant = None, node.meta.get(CONSTANT_MASK)
    if constant is not None:  # computed at import (graph_rewrites): an additive float32 constant
        if constant.dtype == torch.bool:
            constant = torch.zeros(constant.shape).masked_fill(~constant, float("-inf"))
        bias = bb.emit(relax.op.astype(relax.const(constant.float().numpy()), dtype))
    elif mask is not None:
        bias = importer.env[mask]
        if str(bias.ty.dtype) == "bool":
            zero, masked = relax.const(0.0, dtype), relax.const(float("-inf"), dtype)
            bias = bb.emit(relax.op.where(bias, zero, masked))
    if bias is not None:
        heads, kv_heads = int(q.ty.shape[1]), int(k.ty.shape[1])
        if kv_heads != heads:  # enable_gqa: our kernel takes the groups, TVM's masked attention does not
            k, v = (bb.emit(relax.op.repeat(x, heads // kv_heads, axis=1)) for x in (k, v))
    bshd = [bb.emit(relax.op.permute_dims(x, [0, 2, 1, 3])) for x in (q, k, v)]
    out = bb.emit(relax.op.nn.attention(*bshd, bias=bias, causal_mask="TopLeft" if causal else None))
    return bb.emit(relax.op.permute_dims(out, [0, 2, 1, 3]))
