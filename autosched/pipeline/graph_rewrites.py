"""Rewrites of an exported PyTorch graph before it is converted to Relax: what model authors write
that converts badly, or not at all, made into the equivalent that converts well. Each rewrite keeps
the graph's results exactly (but for the order of one rounding, where a docstring says so); each is
skipped where its condition does not hold."""

from __future__ import annotations

# Deferred imports: torch (imported where used: `autosched --help` stays fast).

_SDPA = "aten.scaled_dot_product_attention.default"
_CAT = "aten.cat.default"
_POW = "aten.pow.Tensor_Scalar"
CONSTANT_MASK = "autosched_constant_mask"  # meta key of an attention node: its mask, computed at import


_SDPA_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def sdpa_arguments(node) -> dict:
    """The arguments of a ``scaled_dot_product_attention`` node by name, defaults filled in (``scale``
    and ``enable_gqa`` only where given)."""
    args = dict(zip(_SDPA_POSITIONAL, (None, None, None, None, 0.0, False)))
    args.update(zip(_SDPA_POSITIONAL, node.args))
    args.update(node.kwargs)
    return args


def _set_sdpa_mask(node, mask, causal: bool) -> None:
    """Give the attention node ``mask`` and ``is_causal``, its other arguments as they were."""
    args = sdpa_arguments(node)
    node.args = (args["query"], args["key"], args["value"], mask, args["dropout_p"], causal)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k not in _SDPA_POSITIONAL}


def rewrite_exported(exported) -> None:
    """Apply every rewrite to ``exported`` (a ``torch.export.ExportedProgram``), in place."""
    changed = _constant_masks_folded(exported)
    changed |= _empty_concat_operands_dropped(exported)
    changed |= _integer_powers_multiplied(exported)
    changed |= _written_out_rms_norms_fused(exported)
    if changed:
        exported.graph_module.graph.eliminate_dead_code()
        exported.graph_module.recompile()


def _integer_powers_multiplied(exported) -> bool:
    """``x ** 2`` and ``x ** 3`` of a float tensor as products. TVM compiles CUDA with ``--use_fast_math``
    (``tvm/support/nvcc.py``), where ``powf`` is ``__powf``, exp2(y * log2(x)): NaN for a negative base.
    On the H200 every transformers RMSNorm's ``pow(2)`` and GPT-2's tanh GELU ``pow(3.0)`` made the
    whole output NaN; LLVM's is right. ``x * x`` is exactly ``x ** 2``; ``x * x * x`` rounds once more
    than a correctly rounded cube."""
    import torch

    changed = False
    graph = exported.graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or not str(node.target).startswith(_POW) or len(node.args) != 2:
            continue
        base, exponent = node.args
        if exponent not in (2, 3) or not isinstance(base, torch.fx.Node) \
                or not base.meta["val"].dtype.is_floating_point:
            continue
        with graph.inserting_before(node):
            product = graph.call_function(torch.ops.aten.mul.Tensor, (base, base))
            product.meta = dict(node.meta)
            if exponent == 3:
                product = graph.call_function(torch.ops.aten.mul.Tensor, (product, base))
                product.meta = dict(node.meta)
        node.replace_all_uses_with(product)
        changed = True
    return changed


def _written_out_rms_norms_fused(exported) -> bool:
    """RMSNorm as transformers writes it, as one ``aten.rms_norm`` node, which the importer makes our
    ``rmsnorm`` kernel: ``w * (x32 * rsqrt(mean(x32 * x32, -1) + eps)).to(dtype)`` with ``x32`` the input
    in float32 (Llama, Qwen2, Mistral, Phi-3), or Gemma's ``(x32 * rsqrt(...) * (1 + w32)).to(dtype)``,
    whose weight becomes ``1 + w`` (computed once, at build time). Written out, it was a fused function
    of its own in every model and at every shape, whose records no other kernel could use.

    Not bit-exact in half precision: our kernel multiplies by the weight before its one rounding to the
    model's dtype, where Llama's form rounds the normalised row first; Gemma's ``1 + w`` is rounded to
    the model's dtype. Runs after :func:`_integer_powers_multiplied` (``x ** 2`` is ``x * x`` by then)."""
    import torch

    graph = exported.graph_module.graph
    parameters = set(exported.graph_signature.inputs_to_parameters)
    changed = False
    for rsqrt in list(graph.nodes):
        if _aten(rsqrt) != "rsqrt.default":
            continue
        match = _rms_norm_match(rsqrt, parameters)
        if match is None:
            continue
        x, weight, eps, out, one_plus_weight = match
        with graph.inserting_before(out):
            if one_plus_weight:
                plus_one = graph.call_function(torch.ops.aten.add.Tensor, (weight, 1.0))
                plus_one.meta = dict(weight.meta)
                weight = plus_one
            fused = graph.call_function(torch.ops.aten.rms_norm.default,
                                        (x, [int(x.meta["val"].shape[-1])], weight, eps))
            fused.meta = dict(out.meta)
        out.replace_all_uses_with(fused)
        changed = True
    return changed


def _aten(node) -> str | None:
    """``"mul.Tensor"`` for a call of ``aten.mul.Tensor``; None for other nodes."""
    target = str(node.target) if node.op == "call_function" else ""
    return target[5:] if target.startswith("aten.") else None


def _only_user(node):
    """The one node that uses ``node`` (metadata assertions aside), or None."""
    users = [u for u in node.users if _aten(u) != "_assert_tensor_metadata.default"]
    return users[0] if len(users) == 1 else None


def _rms_norm_match(rsqrt, parameters: set[str]):
    """(x, weight, eps, the node computing the result, whether the weight is used as 1 + w) of the
    RMSNorm around ``rsqrt`` (see :func:`_written_out_rms_norms_fused`); None for anything else."""
    import torch

    def cast(node, dtype):  # the node's input if it is a cast to ``dtype`` and nothing else, else None
        if _aten(node) != "_to_copy.default" or node.kwargs.get("dtype") != dtype:
            return None
        same_place = node.meta["val"].device == node.args[0].meta["val"].device
        plain = node.kwargs.get("layout", torch.strided) == torch.strided \
            and node.kwargs.get("memory_format") in (None, torch.preserve_format)
        return node.args[0] if same_place and plain else None

    def is_weight(node, n: int, dtype) -> bool:  # a parameter of shape [n] and the model's dtype
        return node.op == "placeholder" and node.name in parameters \
            and tuple(node.meta["val"].shape) == (n,) and node.meta["val"].dtype == dtype

    def other(mul, node):  # the other operand of a product with ``node``
        if _aten(mul) != "mul.Tensor" or len(mul.args) != 2 or node not in mul.args:
            return None
        return mul.args[1] if mul.args[0] is node else mul.args[0]

    add_eps = rsqrt.args[0]
    if _aten(add_eps) != "add.Tensor" or not isinstance(add_eps.args[1], float):
        return None
    mean, eps = add_eps.args
    if _aten(mean) != "mean.dim" or len(mean.args) != 3 or mean.args[2] is not True:
        return None
    square = mean.args[0]
    if _aten(square) != "mul.Tensor" or square.args[0] is not square.args[1]:
        return None
    x32 = square.args[0]
    rank = x32.meta["val"].dim()
    if x32.meta["val"].dtype != torch.float32 or list(mean.args[1]) not in ([-1], [rank - 1]):
        return None
    x = cast(x32, torch.float32)
    x = x if x is not None else x32
    dtype, n = x.meta["val"].dtype, int(x.meta["val"].shape[-1])
    normalised = next((u for u in rsqrt.users if other(u, rsqrt) is x32), None)
    after = _only_user(normalised) if normalised is not None else None
    if after is None:
        return None
    # Llama's form: the weight times the normalised row in the model's dtype.
    if dtype == torch.float32:
        rounded, product = normalised, after
    else:
        rounded = after if cast(after, dtype) is normalised else None
        product = _only_user(rounded) if rounded is not None else None
    if product is not None:
        weight = other(product, rounded)
        if weight is not None and is_weight(weight, n, dtype):
            return x, weight, eps, product, False
    # Gemma's form: the normalised row times (1 + the weight in float32), then cast.
    plus_one = other(after, normalised)
    if plus_one is None or _aten(plus_one) != "add.Tensor" or plus_one.args[1] != 1.0:
        return None
    w32 = plus_one.args[0]
    weight = w32 if dtype == torch.float32 else cast(w32, torch.float32)
    result = after if dtype == torch.float32 else _only_user(after)
    if weight is None or not is_weight(weight, n, dtype) or result is None:
        return None
    if dtype != torch.float32 and cast(result, dtype) is not after:
        return None
    return x, weight, eps, result, True


def _empty_concat_operands_dropped(exported) -> bool:
    """``cat`` without its empty operands: a partial rotary embedding at full width (Phi-3's) concatenates
    the rotated half with an empty slice, whose zero-extent kernel TVM's default GPU schedule divides by
    ("Divide by zero" in dlight's fallback rule)."""
    changed = False
    for node in list(exported.graph_module.graph.nodes):
        if node.op != "call_function" or str(node.target) != _CAT:
            continue
        tensors = list(node.args[0])
        kept = [t for t in tensors if t.meta["val"].numel() != 0]
        if not kept or len(kept) == len(tensors):
            continue
        if len(kept) == 1 and tuple(kept[0].meta["val"].shape) == tuple(node.meta["val"].shape):
            node.replace_all_uses_with(kept[0])
        else:
            node.args = (kept, *node.args[1:])
        changed = True
    return changed


def _constant_masks_folded(exported) -> bool:
    """A mask that attention gets from constants alone (no model input) is computed here, once: the
    causal pattern becomes ``is_causal=True`` (our causal kernel, which skips the masked blocks), any
    other becomes the additive mask stored in the attention node's ``meta[CONSTANT_MASK]``, which the
    attention converter reads.

    Hugging Face's models build their masks with ``arange`` comparisons and, under ``torch.export``,
    always hand them to attention (an exported graph may later see other shapes); at our static shapes
    and with no padding input the causal one is ``is_causal``'s. Left in the graph, a sliding-window
    mask (Mistral's) became a boolean kernel that TVM's LLVM code generator refuses. A mask that depends
    on a model input is left as it is.
    """
    import torch

    values, changed = _constant_values(exported), False
    for node in list(exported.graph_module.graph.nodes):
        if node.op != "call_function" or str(node.target) != _SDPA:
            continue
        args = sdpa_arguments(node)
        q, k, mask = args["query"], args["key"], args["attn_mask"]
        if mask is None or args["dropout_p"] != 0.0 or args["is_causal"] or not isinstance(mask, torch.fx.Node):
            continue
        value = values(mask)
        if value is None:
            continue
        keep = value if value.dtype == torch.bool else value == 0
        sq, skv = q.meta["val"].shape[-2], k.meta["val"].shape[-2]
        causal = torch.ones(sq, skv, dtype=torch.bool).tril()
        additive = value.dtype != torch.bool and bool(((value == 0) | (value == float("-inf"))).all())
        if sq == skv and (value.dtype == torch.bool or additive) and keep.shape[-2:] == (sq, skv) \
                and bool((keep == causal).all()):
            _set_sdpa_mask(node, None, causal=True)
        else:
            node.meta[CONSTANT_MASK] = value
            _set_sdpa_mask(node, None, causal=False)
        changed = True
    return changed


def _constant_values(exported):
    """A function of an FX node: its value if it depends on no model input (only on parameters, buffers,
    constants and shapes), else None. Values are computed with torch, once each."""
    import torch

    sig = exported.graph_signature
    named = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    stored = {**exported.state_dict, **exported.constants}
    memo: dict = {}

    def value(node):
        if node in memo:
            return memo[node]
        memo[node] = None  # until computed: a cycle cannot occur in an FX graph, an input stays None
        if node.op == "placeholder":
            result = stored.get(named.get(node.name))
        elif node.op == "call_function":
            missing = []

            def arg(a):
                v = value(a)
                if v is None:
                    missing.append(a)
                return v

            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), arg)
            if missing:
                return None
            try:
                with torch.no_grad():
                    result = node.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - an op that cannot run eagerly here: not a constant to us
                result = None
        else:
            result = None
        memo[node] = result
        return result

    return value
