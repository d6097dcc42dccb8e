"""Greedy choice on the device: each row's first index of its largest logit (numpy's ``argmax``), so that a
greedy step reads back one token per sequence instead of the whole [sequences, vocabulary] logits.

One kernel over a symbolic number of rows. On a GPU each row is one CTA whose threads scan the vocabulary
side by side and meet in a cross-thread reduction of (index, value) pairs (TVM's default schedules give a
reduction of symbolic rows one thread per row, which walks the whole vocabulary alone).
"""

from __future__ import annotations

THREADS = 1024  # per row: a 32000-token vocabulary is 32 coalesced loads a thread


def greedy_kernel(vocab: int, gpu: bool):
    """The PrimFunc ``(logits [n, vocab] float32) -> (index [n] int32, value [n] float32)``, scheduled for a
    GPU if ``gpu`` (else as written, for the CPU's compiler)."""
    from tvm import s_tir, te, tirx

    n = tirx.Var("n", "int64")
    logits = te.placeholder((n, vocab), "float32", name="logits")

    def combine(x, y):  # keep x where larger, or equal at a smaller index: the first maximum
        keep = tirx.Or(x[1] > y[1], tirx.And(x[1] == y[1], x[0] < y[0]))
        return tirx.Select(keep, x[0], y[0]), tirx.Select(x[1] > y[1], x[1], y[1])

    def identity(index_dtype, value_dtype):
        return tirx.const(-1, index_dtype), tirx.min_value(value_dtype)

    first_max = te.comm_reducer(combine, identity, name="first_max")
    k = te.reduce_axis((0, vocab), name="k")
    index, value = te.compute((n,), lambda i: first_max((k.var.astype("int32"), logits[i, k]), axis=k), name="best")
    # The value is an output too: on a GPU the reduction's second result cannot live in a buffer of its own.
    # Opaque to fusion, and without the ``main`` symbol TE gives it (the module names it).
    func = te.create_prim_func([logits, index, value]).with_attr("op_pattern", 8).without_attr("global_symbol")
    if not gpu:
        return func
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("best")
    row, column = sch.get_loops(block)
    _, lane = sch.split(column, [None, THREADS])
    sch.bind(row, "blockIdx.x")
    sch.bind(lane, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True).without_attr("global_symbol")
