"""The decoder's blocks, as ``tvm.relax.frontend.nn`` modules over a :class:`~..decoder.DecoderConfig`: what a
traced model computes, one file a kind of block.

- :mod:`.projections`: the linear layers (float, or quantised weights);
- :mod:`.norms`: RMSNorm and LayerNorm, and the residual add fused with the norm that reads it;
- :mod:`.positions`: the token and position embeddings, the rotary embedding of a frequency table;
- :mod:`.attention`: self-attention over the paged KV cache (fused q/k/v, q/k norms, rotary);
- :mod:`.mlp`: the dense MLP (gated or not) and the mixture of experts;
- :mod:`.decoder`: the layer (pre-norm, sequential attention then MLP) and the model with the functions a
  generation runtime calls, and its KV caches.

A family is a choice of blocks made by its config's fields (:data:`~..decoder.TRAITS`); a family whose layer is
shaped differently gets a layer class of its own beside :class:`~.decoder.DecoderLayer`.
"""
