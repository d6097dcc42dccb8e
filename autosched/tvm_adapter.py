"""Every private or fragile TVM API autosched relies on, in one module.

Each function here names what it needs from TVM 0.27 and hides how it is obtained: a private module, a
constructor called through the FFI, a schedule-state edit. ``tests/test_tvm_adapter.py`` pins the
behaviour of each, so a TVM upgrade that changes one fails there first, and is a change to this file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tvm import s_tir
    from tvm.s_tir.schedule import SBlockRV

# Pass options that split a loop's last, guarded iteration off (conditions wrapped in ``likely``), so the
# rest runs without the guard; the rows space needs them to keep a row's tail vectorised.
LOOP_PARTITION = {"s_tir.LoopPartition": {"partition_const_loop": True}}


def cache_frozen_frame_lookups() -> None:
    """Make TVMScript's parsing under an import cheap: TVMScript calls ``inspect.stack()`` for each function
    it parses, and for each frame of Python's import machinery (``<frozen importlib._bootstrap>``, a file
    that does not exist) ``inspect.getmodule`` scans all of ``sys.modules`` and finds nothing. Importing
    TVM's tensor intrinsics (hundreds of functions, which dlight's matmul rule imports on first use) took 50
    s of a GPT-2 build for CUDA with torch loaded. The scan's answer, no module, is cached here up front:
    ``getmodule`` returns the same None, without the scan."""
    import _imp
    import inspect

    try:  # every frozen module's frame file name, e.g. <frozen importlib._bootstrap>, <frozen runpy>
        filenames = {_imp.get_frozen_object(name).co_filename for name in _imp._frozen_module_names()}
    except (AttributeError, ImportError):  # not CPython 3.11+: the import machinery's two
        filenames = {"<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>"}
    for filename in filenames:
        inspect.modulesbyfile.setdefault(filename, filename)  # a module name that is never in sys.modules


def block_realize(sch: s_tir.Schedule, block: SBlockRV):
    """The ``SBlockRealize`` of ``block``: its iterator bindings and its predicate (dlight's helper)."""
    from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize

    return get_sblockrealize(sch, block)


def set_block_predicate(sch: s_tir.Schedule, block: SBlockRV, predicate: Any) -> bool:
    """Replace the predicate of ``block`` in place; False, and nothing changed, unless the block is the only
    statement of its innermost loop. No schedule primitive sets a predicate; this edits the schedule state
    (``ScheduleState.replace``), keeping the block, so its handles stay valid."""
    from tvm import s_tir, tirx

    loops = sch.get_loops(block)
    if not loops:
        return False
    loop = sch.get(loops[-1])
    realize = loop.body
    if not isinstance(realize, s_tir.SBlockRealize):
        return False
    guarded = s_tir.SBlockRealize(realize.iter_values, predicate, realize.block)
    new_loop = tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, guarded, loop.thread_binding, loop.annotations)
    sch.state.replace(sch.get_sref(loops[-1]), new_loop, {realize.block: realize.block})
    return True


def feature_tune_context(tvm_target: Any):
    """A MetaSchedule ``TuneContext`` that carries only ``tvm_target``, for its feature extractor.

    ``TuneContext.__init__`` imports ``tvm.s_tir.tensor_intrin``, which parses hundreds of TVMScript
    intrinsics (about 100 s on 2 cores) the feature extractor never uses; the FFI constructor, with its
    8 positional arguments (mod, target, space generator, search strategy, task name, threads, seed,
    logger), does not.
    """
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule import _ffi_api

    ctx = ms.TuneContext.__new__(ms.TuneContext)
    ctx.__init_handle_by_constructor__(_ffi_api.TuneContext, None, tvm_target, None, None, "main", 1, -1, None)
    return ctx


def llm_prefill_kernels():
    """TVM's private module of LLM KV-cache kernel builders (``relax.frontend.nn.llm._kernel_common``), whose
    prefill macros and tile rules the FlashAttention template space uses."""
    from tvm.relax.frontend.nn.llm import _kernel_common

    return _kernel_common


def register_llvm_lowering(op_name: str, lower: Callable, level: int = 99) -> None:
    """Lower ``op_name`` with ``lower`` on every LLVM target compiled after this, process-wide."""
    from tvm import tirx

    tirx.register_intrin_lowering(op_name, target="llvm", f=lower, level=level)


def convert_attention_as_tvm_does(importer: Any, node: Any) -> Any:
    """TVM's own conversion of ``scaled_dot_product_attention`` (a method of the exported-program
    importer): what our attention converter hands over the forms it does not take (dropout, 2-D)."""
    return importer._scaled_dot_product_attention(node)
