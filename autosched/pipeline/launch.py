"""Programmatic dependent launch (Hopper): a kernel may start while the kernel before it on the stream is still
finishing, and waits for it only where it must.

Between two kernels of a decode step the GPU otherwise drains the first (its last CTAs, the memory flush),
then launches and ramps up the second: a few microseconds a boundary, and a step has hundreds of them. With
the launch attribute (TVM's ``tirx.use_programtic_dependent_launch`` tag) the next grid is launched as soon as
every CTA of the running one has triggered (``griddepcontrol.launch_dependents``), and each of its threads
waits at ``griddepcontrol.wait`` until the previous grid has completed and its writes are visible.

:func:`programmatic_launch` gives that to the GPU kernels of a module that TVM's default TIR pipeline
compiles, and to our TIRx kernels: every kernel (each outermost thread-bound loop nest; a TIRx kernel's body
after its CTA and thread ids) first waits, then triggers, so its reads and writes are ordered exactly as
without the attribute, and only the launch overlaps. A kernel the rewrite cannot reach with certainty (a
statement kind it does not know encloses it) leaves its function untouched: the attribute without the wait
would let it read its inputs before they are written.

With a :class:`WeightPrefetch`, a kernel that reads a model weight first asks L2 for its block's share of it
(``cp.async.bulk.prefetch.L2``, one thread a block), then waits: no kernel writes a weight, so its bytes may be
fetched while the kernel before is still running, where the plain wait leaves the launched blocks idle. An L2
prefetch changes no value a kernel reads (L2 is where the GPU's writes meet), only when the bytes arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

PDL_TAG = "tirx.use_programtic_dependent_launch"  # TVM's spelling
LAUNCH_PARAMS_ATTR = "tirx.kernel_launch_params"
DEVICE_ENTRY = "tirx.device_entry"  # a TIRx kernel's body (T.device_entry())


@dataclass(frozen=True)
class WeightPrefetch:
    """What a kernel prefetches before its wait: the share of its input at ``position`` (a weight, as
    :func:`autosched.pipeline.tasks.weight_inputs` finds them) that each of its blocks reads, all blocks
    together at most ``budget`` bytes (beyond what the kernel before leaves time to fetch, a prefetch only
    evicts what the next reads)."""

    position: int
    budget: int


class _Unreachable(Exception):
    """A statement kind the rewrite does not walk into, which might hold a kernel."""


def _grid_sync():
    """``griddepcontrol.wait`` then ``griddepcontrol.launch_dependents``, as two statements."""
    from tvm import tirx
    from tvm.script import tirx as T  # noqa: F401 - registers the PTX intrinsics

    return [tirx.Evaluate(tirx.call_intrin("void", "tirx.ptx.griddepcontrol", action, ""))
            for action in ("wait", "launch_dependents")]


def _prefetch(buffer, budget: int, blocks: int, block):
    """The statement by which block ``block`` of ``blocks`` asks L2 for its share of ``buffer`` (the blocks' equal
    shares in order, as a GEMV's blocks read their rows), at most ``budget`` bytes over all blocks; None where
    that leaves a block less than the 16 bytes a bulk prefetch moves."""
    from tvm import tirx
    from tvm.script import tirx as T

    elem_bytes = buffer.dtype.bits * buffer.dtype.lanes // 8
    shape = [int(x) for x in buffer.shape]
    total = elem_bytes
    for extent in shape:
        total *= extent
    share = -(-total // blocks // 16) * 16  # bytes per block, whole 16-byte units
    size = min(share, budget // blocks // 16 * 16)
    if size < 16 or share % elem_bytes:
        return None
    start = block * share
    size = tirx.min(size, (total - start) // 16 * 16)  # the last block's share may be short
    index, indices = block * (share // elem_bytes), []
    for extent in reversed(shape):
        indices.insert(0, index % extent)
        index = index // extent
    address = tirx.call_intrin("handle", "tirx.address_of", tirx.BufferLoad(buffer, indices))
    fetch = tirx.Evaluate(T.ptx["cp.async.bulk.prefetch.L2.global"](address, tirx.Cast("uint32", size)))
    return tirx.IfThenElse(start + 16 <= total, fetch, None)


def _first_thread_nest(stmt) -> list | None:
    """The thread-binding loops (threadIdx.*) directly nested at the head of ``stmt`` (through blocks and the
    first statement of sequences): a kernel's threads, for a statement of one thread; None if there are none."""
    from tvm import s_tir, tirx

    loops = []
    while True:
        if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.THREAD_BINDING and stmt.thread_binding is not None \
                and stmt.thread_binding.thread_tag.startswith("threadIdx"):
            loops.append(stmt)
            stmt = stmt.body
        elif isinstance(stmt, tirx.SeqStmt) and not loops:
            stmt = stmt.seq[0]
        elif isinstance(stmt, s_tir.SBlockRealize) and not loops:
            stmt = stmt.block.body
        else:
            return loops or None


def _one_thread(loops: list, stmt):
    """``stmt`` for thread 0 of the block alone, in fresh loops over the threads of ``loops``."""
    from tvm import tirx

    fresh = [tirx.Var(f"prefetch_{loop.thread_binding.thread_tag.replace('.', '_')}", loop.loop_var.ty)
             for loop in loops]
    condition = fresh[0] == 0
    for var in fresh[1:]:
        condition = tirx.And(condition, var == 0)
    body = tirx.IfThenElse(condition, stmt, None)
    for loop, var in reversed(list(zip(loops, fresh))):
        binding = tirx.IterVar(loop.thread_binding.dom, var, loop.thread_binding.iter_type,
                               loop.thread_binding.thread_tag)
        body = tirx.For(var, loop.min, loop.extent, tirx.ForKind.THREAD_BINDING, body, binding)
    return body


def _with_grid_sync(stmt, kernels: list, weight=None):
    """``stmt`` with the grid sync first in every kernel it holds (each one's launch axis or TIRx entry appended
    to ``kernels``); raises _Unreachable where unsure. ``weight``: (buffer, budget) of a :class:`WeightPrefetch`,
    prefetched before the sync where the kernel's blocks are one axis (blockIdx.x) of threads it can find."""
    from tvm import s_tir, tirx

    def walk(s):
        return _with_grid_sync(s, kernels, weight)

    if isinstance(stmt, tirx.For):
        if stmt.kind == tirx.ForKind.THREAD_BINDING:  # the kernel's outermost launch loop
            tag = stmt.thread_binding.thread_tag if stmt.thread_binding is not None else ""
            kernels.append(tag)
            first = []
            threads = _first_thread_nest(stmt.body) if weight is not None and tag == "blockIdx.x" else None
            if threads is not None and isinstance(stmt.extent, tirx.IntImm):
                fetch = _prefetch(weight[0], weight[1], int(stmt.extent), stmt.loop_var)
                first = [] if fetch is None else [_one_thread(threads, fetch)]
            body = tirx.SeqStmt([*first, *_grid_sync(), stmt.body])
        else:
            body = walk(stmt.body)
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding,
                        stmt.annotations, stmt.step, stmt.span)
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([walk(s) for s in stmt.seq], stmt.span)
    if isinstance(stmt, s_tir.SBlockRealize):
        return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, walk(stmt.block), stmt.span)
    if isinstance(stmt, s_tir.SBlock):
        init = None if stmt.init is None else walk(stmt.init)
        return s_tir.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, walk(stmt.body),
                            init, stmt.alloc_buffers, stmt.match_buffers, stmt.annotations, stmt.span)
    if isinstance(stmt, tirx.IfThenElse):
        other = None if stmt.else_case is None else walk(stmt.else_case)
        return tirx.IfThenElse(stmt.condition, walk(stmt.then_case), other, stmt.span)
    if isinstance(stmt, tirx.AttrStmt):
        if stmt.attr_key == "thread_extent":  # a launch written without a loop: not walked into
            raise _Unreachable(stmt.attr_key)
        if stmt.attr_key == DEVICE_ENTRY:  # a TIRx kernel: after its CTA/thread ids and buffers
            kernels.append(DEVICE_ENTRY)
            return _after_preamble(stmt, weight)
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, walk(stmt.body), stmt.span)
    if isinstance(stmt, tirx.While):
        return tirx.While(stmt.condition, walk(stmt.body), stmt.span)
    leaves = (tirx.BufferStore, tirx.Evaluate, tirx.Bind, tirx.AssertStmt, tirx.DeclBuffer, tirx.AllocBuffer)
    if isinstance(stmt, leaves):
        return stmt
    raise _Unreachable(type(stmt).__name__)


def _after_preamble(stmt, weight):
    """A TIRx kernel's entry ``stmt`` with the grid sync (and the weight's prefetch before it) after the kernel's
    CTA and thread ids and buffers, inside the attributes that wrap them (e.g. the launch bounds)."""
    from tvm import tirx

    inner = stmt.body
    if isinstance(inner, tirx.AttrStmt):
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, _after_preamble(inner, weight), stmt.span)
    body = inner.seq if isinstance(inner, tirx.SeqStmt) else [inner]
    preamble = (tirx.ScopeIdDefStmt, tirx.AllocBuffer, tirx.DeclBuffer)
    first = next((i for i, s in enumerate(body) if not isinstance(s, preamble)), len(body))
    fetch = _tirx_prefetch(body[:first], weight) if weight is not None else []
    body = tirx.SeqStmt([*body[:first], *fetch, *_grid_sync(), *body[first:]])
    return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body, stmt.span)


def _scope_ids(preamble: list) -> dict[int, tuple]:
    """A TIRx kernel's scope ids by binding (:func:`_binding`): (vars, extents) of each."""
    from tvm import tirx

    found = {}
    for stmt in preamble:
        if isinstance(stmt, tirx.ScopeIdDefStmt):
            definition = getattr(stmt, "def")
            found.setdefault(int(definition.scope), (list(definition.def_ids), list(definition.extents or [])))
    return found


def _binding(parent: str, cur: str) -> int:
    """The binding TVM stores for scope ids of ``cur`` within ``parent`` (e.g. "kernel", "cta": CTA ids)."""
    from tvm import tirx

    return int(tirx.exec_scope.ScopeIdDef([tirx.Var("v", "int32")], [1], parent, cur).scope)


def _tirx_prefetch(preamble: list, weight) -> list:
    """A TIRx kernel's prefetch (thread 0 of each CTA), where its CTAs and threads are each one axis."""
    from tvm import tirx

    ids = _scope_ids(preamble)
    cta, thread = ids.get(_binding("kernel", "cta")), ids.get(_binding("cta", "thread"))
    if cta is None or thread is None or len(cta[0]) != 1 or len(thread[0]) != 1 or len(cta[1]) != 1 \
            or not isinstance(cta[1][0], tirx.IntImm):
        return []
    fetch = _prefetch(weight[0], weight[1], int(cta[1][0]), cta[0][0])
    return [] if fetch is None else [tirx.IfThenElse(thread[0][0] == 0, fetch, None)]


def with_programmatic_launch(func, prefetch: WeightPrefetch | None = None):
    """``func`` (a PrimFunc) with every kernel waiting for, then releasing, the grid before it and the launch
    attribute set; ``func`` itself where it launches nothing, has the attribute already or holds a statement
    the rewrite cannot walk. ``prefetch``: the weight its blocks ask L2 for before they wait."""
    from tvm import tirx

    if func.attrs is not None and LAUNCH_PARAMS_ATTR in func.attrs:
        return func
    kernels: list[str] = []
    weight = None
    if prefetch is not None and prefetch.position < len(func.params):
        buffer = func.params[prefetch.position]  # a PrimFunc's parameters are its buffers
        weight = (buffer, prefetch.budget) if isinstance(buffer, tirx.Buffer) else None
    try:
        body = _with_grid_sync(func.body, kernels, weight)
    except _Unreachable:
        return func
    if not kernels:  # runs on the host
        return func
    return func.with_body(body).with_attr(LAUNCH_PARAMS_ATTR, [PDL_TAG])


def programmatic_launch(only=None, prefetch: dict[str, WeightPrefetch] | None = None):
    """A module pass: :func:`with_programmatic_launch` on each PrimFunc (the Relax functions untouched), or on
    those named in ``only``, each with its entry in ``prefetch`` if it has one. For the end of a GPU build's Relax
    pipeline, once every kernel is scheduled (dlight included)."""
    import tvm
    from tvm import tirx

    @tvm.transform.module_pass(opt_level=0, name="ProgrammaticLaunch")
    def rewrite(mod, _ctx):
        for gv, func in list(mod.functions.items()):
            if isinstance(func, tirx.PrimFunc) and (only is None or gv.name_hint in only):
                mod[gv] = with_programmatic_launch(func, (prefetch or {}).get(gv.name_hint))
        return mod

    return rewrite
