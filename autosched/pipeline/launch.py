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
"""

from __future__ import annotations

PDL_TAG = "tirx.use_programtic_dependent_launch"  # TVM's spelling
LAUNCH_PARAMS_ATTR = "tirx.kernel_launch_params"
DEVICE_ENTRY = "tirx.device_entry"  # a TIRx kernel's body (T.device_entry())


class _Unreachable(Exception):
    """A statement kind the rewrite does not walk into, which might hold a kernel."""


def _grid_sync():
    """``griddepcontrol.wait`` then ``griddepcontrol.launch_dependents``, as two statements."""
    from tvm import tirx
    from tvm.script import tirx as T  # noqa: F401 - registers the PTX intrinsics

    return [tirx.Evaluate(tirx.call_intrin("void", "tirx.ptx.griddepcontrol", action, ""))
            for action in ("wait", "launch_dependents")]


def _with_grid_sync(stmt, kernels: list):
    """``stmt`` with the grid sync first in every kernel it holds (each one's launch axis or TIRx entry appended
    to ``kernels``); raises _Unreachable where unsure."""
    from tvm import s_tir, tirx

    def walk(s):
        return _with_grid_sync(s, kernels)

    if isinstance(stmt, tirx.For):
        if stmt.kind == tirx.ForKind.THREAD_BINDING:  # the kernel's outermost launch loop
            kernels.append(stmt.thread_binding.thread_tag if stmt.thread_binding is not None else "")
            body = tirx.SeqStmt([*_grid_sync(), stmt.body])
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
            body = stmt.body.seq if isinstance(stmt.body, tirx.SeqStmt) else [stmt.body]
            preamble = (tirx.ScopeIdDefStmt, tirx.AllocBuffer, tirx.DeclBuffer)
            first = next((i for i, s in enumerate(body) if not isinstance(s, preamble)), len(body))
            body = tirx.SeqStmt([*body[:first], *_grid_sync(), *body[first:]])
            return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body, stmt.span)
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, walk(stmt.body), stmt.span)
    if isinstance(stmt, tirx.While):
        return tirx.While(stmt.condition, walk(stmt.body), stmt.span)
    leaves = (tirx.BufferStore, tirx.Evaluate, tirx.Bind, tirx.AssertStmt, tirx.DeclBuffer, tirx.AllocBuffer)
    if isinstance(stmt, leaves):
        return stmt
    raise _Unreachable(type(stmt).__name__)


def with_programmatic_launch(func):
    """``func`` (a PrimFunc) with every kernel waiting for, then releasing, the grid before it and the launch
    attribute set; ``func`` itself where it launches nothing, has the attribute already or holds a statement
    the rewrite cannot walk."""
    if func.attrs is not None and LAUNCH_PARAMS_ATTR in func.attrs:
        return func
    kernels: list[str] = []
    try:
        body = _with_grid_sync(func.body, kernels)
    except _Unreachable:
        return func
    if not kernels:  # runs on the host
        return func
    return func.with_body(body).with_attr(LAUNCH_PARAMS_ATTR, [PDL_TAG])


def programmatic_launch(only=None):
    """A module pass: :func:`with_programmatic_launch` on each PrimFunc (the Relax functions untouched), or on
    those named in ``only``. For the end of a GPU build's Relax pipeline, once every kernel is scheduled
    (dlight included)."""
    import tvm
    from tvm import tirx

    @tvm.transform.module_pass(opt_level=0, name="ProgrammaticLaunch")
    def rewrite(mod, _ctx):
        for gv, func in list(mod.functions.items()):
            if isinstance(func, tirx.PrimFunc) and (only is None or gv.name_hint in only):
                mod[gv] = with_programmatic_launch(func)
        return mod

    return rewrite
