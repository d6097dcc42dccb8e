"""Building a generation artifact: the decoder of :mod:`.decoder` lowered like any model of ours, its
kernels scheduled from the database (TVM's default schedules where nothing serves them), compiled into
one library with the paged KV cache's functions, and written next to the weights and a manifest."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autosched.artifact import GENERATION_FORMAT as FORMAT
from autosched.artifact import GENERATION_LIBRARY as LIBRARY
from autosched.artifact import MANIFEST_VERSION, PARAMS, kernel_sources, write_artifact
from autosched.errors import UsageError
from autosched.pipeline.build import ApplyReport, build_summary

from .checkpoint import CheckpointTensors
from .decoder import DecoderConfig, config_from_hf, export, weights_from_hf, window_rope_unsupported
from .quantize import manifest_entry, quantize_weights

if TYPE_CHECKING:
    from autosched.database.store import Database
    from autosched.target import TargetSpec

DEFAULT_PAGE_SIZE = 16

# The functions TVM's paged KV cache calls for attention, by what they do: TVM's kernels (the default TIR
# ones) until ours take their place.
ATTENTION_ROLES = {
    "prefill over new tokens (ragged)": ("batch_prefill_ragged_kv",),
    "prefill over cached pages": ("batch_prefill_paged_kv",),
    "decode over cached pages": ("batch_decode_paged_kv",),
    "merge of partial attention": ("tir_attention_merge_state",),
    "rotary embedding and q/k/v split": ("fused_rope",),
}


@dataclass
class GenerationModel:
    """A transformers causal LM and what a generation build needs of it."""

    spec: str
    hf: Any  # transformers.PreTrainedModel
    config: DecoderConfig
    eos_token_ids: list[int] = field(default_factory=list)
    # Projections already quantised by the checkpoint (a GPTQ or AWQ folder), as the decoder's parameters by name.
    prequantized: dict[str, Any] = field(default_factory=dict)
    # Where the quantised codes come from: "build" (quantised from the float weights), "gptq", "awq" or
    # "compressed-tensors" (FP8).
    quant_source: str = "build"
    # The checkpoint's tensors read one at a time (.checkpoint), where ``hf`` is None: the model was never loaded whole.
    state: Any = None


def _torch_dtype_name(module) -> str:
    dtype = next(module.parameters()).dtype
    return str(dtype).replace("torch.", "")


def find_hf_model(module):
    """The transformers ``PreTrainedModel`` inside ``module`` (itself, or a wrapper's submodule such as the
    ``hf-*`` examples' logits wrapper); None if there is none."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel):
            return sub
    return None


def model_folder(spec: str) -> Path:
    """The folder a model ``spec`` names: itself, or for a Hugging Face cache folder (``models--org--name``, as
    ``huggingface_hub`` downloads into ``~/.cache/huggingface/hub``) the snapshot its ``refs/main`` names, else its
    only snapshot; a one-line UsageError where there are several and no ref says which."""
    path = Path(spec)
    snapshots = path / "snapshots"
    if not (path.name.startswith("models--") and snapshots.is_dir()):
        return path
    ref = path / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    found = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    if len(found) == 1:
        return snapshots / found[0]
    raise UsageError(f"{spec} is a Hugging Face cache folder with {len(found)} snapshots and no refs/main: give one, "
                     f"e.g. {snapshots / found[0]}" if found else f"{spec} is a Hugging Face cache folder without "
                     "snapshots: download the model again")


def load_generation_model(spec: str, dtype: str | None = None, quantize: str | None = None) -> GenerationModel:
    """A model to generate with: a folder written by transformers' ``save_pretrained`` or a Hugging Face cache folder
    (:func:`model_folder`; read locally, nothing downloaded), an example name (``hf-llama``, ...) or a
    ``module:factory`` whose model is a transformers causal LM of a supported family. ``quantize``: a weight
    quantisation scheme of :mod:`.quantize` (its projections quantised when built)."""
    import torch

    from .prequantized import choose_scheme
    from .quantize import check_prequantized, check_quantizable, scheme

    if quantize:
        scheme(quantize)  # an unknown scheme is refused before the model loads

    from .awq import awq_config, load_awq
    from .fp8 import COMPRESSED_TENSORS, check_fp8_config, fp8_config, load_fp8
    from .gptq import gptq_config, load_gptq

    path = model_folder(spec)
    prequantized, group, source = {}, None, "build"
    readers = {"gptq": (gptq_config, load_gptq), "awq": (awq_config, load_awq)}
    found = [name for name, (detect, _) in readers.items() if path.is_dir() and detect(path) is not None]
    if path.is_dir() and fp8_config(path) is not None:
        source = COMPRESSED_TENSORS
        check_fp8_config(fp8_config(path))  # what it cannot read is named before --quantize is
        if quantize not in (None, "fp8"):
            raise UsageError(f"{spec} is an FP8 checkpoint, which builds as fp8: leave out --quantize {quantize}")
        hf, prequantized = load_fp8(path, dtype)
        quantize = "fp8"
    elif found:
        source = found[0]
        if quantize not in (None, "q4f16", "q4f16_zp"):
            raise UsageError(
                f"{spec} is a checkpoint quantised with {source.upper()}, which builds as q4f16 (q4f16_zp with "
                f"zero points other than 8): leave out --quantize {quantize}"
            )
        hf, prequantized, group = readers[source][1](path, dtype)
        quantize, prequantized = choose_scheme(prequantized, quantize, source.upper())
    elif path.is_dir():
        if not (path / "config.json").exists():
            raise UsageError(f"{spec} is a folder without config.json: give a folder written by save_pretrained")
        try:
            from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
        except ImportError:
            raise UsageError("loading a Hugging Face folder needs transformers: pip install transformers") from None
        state = CheckpointTensors.open(path, getattr(torch, dtype) if dtype else None)
        if state is not None:  # read tensor by tensor as the build maps them, not loaded whole first
            hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
            dtype = dtype or str(getattr(hf_config, "dtype", None) or "float32").replace("torch.", "")
            config = config_from_hf(hf_config, dtype)
            if quantize:
                check_quantizable(config, quantize)
                config = replace(config, quantize=quantize)
            generation = GenerationConfig.from_pretrained(str(path)) if (path / "generation_config.json").is_file() else None
            return GenerationModel(spec, None, config, _eos_ids(generation, hf_config, config), state=state)
        kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
        hf = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **kwargs).eval()
    else:
        from autosched.pipeline.load import load_model

        model = load_model(spec, **({"dtype": getattr(torch, dtype)} if dtype else {}))
        hf = find_hf_model(model.module)
        if hf is None:
            raise UsageError(f"'{spec}' is not a transformers causal LM: generation builds a model whose factory "
                             "returns one (hf-llama, ..., or a save_pretrained folder)")
        hf = hf.eval()
    config = config_from_hf(hf.config, dtype or _torch_dtype_name(hf))
    if quantize:
        check_quantizable(config, quantize)
        config = replace(config, quantize=quantize)
    if source != "build":
        check_prequantized(config, group, "FP8" if source == COMPRESSED_TENSORS else source.upper())
    return GenerationModel(spec, hf, config, _eos_ids(getattr(hf, "generation_config", None), hf.config, config),
                           prequantized, source)


def _eos_ids(generation_config, hf_config, config: DecoderConfig) -> list[int]:
    """The end-of-sequence ids: generation_config's (one or several), else the model config's; those in the
    vocabulary."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return [i for i in eos_ids if 0 <= i < config.vocab]


@dataclass
class GenerationReport(ApplyReport):
    """A model build's report (:class:`~autosched.pipeline.build.ApplyReport`: tuned, transferred and default
    kernels, records slower than the default) and what a generation build adds: the attention functions the
    cache runs and the kernels of our workloads."""

    attention: dict[str, str] = field(default_factory=dict)  # role -> what runs it
    # Kernels of our workloads (each linear layer of the static functions): name -> workload key, space and
    # where its schedule came from.
    workloads: dict[str, dict[str, str]] = field(default_factory=dict)

    def summary(self) -> str:
        ours = sorted(role for role, runs in self.attention.items() if runs.startswith("autosched"))
        seconds, self.seconds = self.seconds, {}
        try:
            text = build_summary(self)
        finally:
            self.seconds = seconds
        text += (f", {len(self.workloads)} of our workloads; attention on TVM's default paged-KV kernels"
                 + (f" except ours for {', '.join(ours)}" if ours else ""))
        return text + "; " + ", ".join(f"{step} {s:.1f} s" for step, s in self.seconds.items())


def lower_generation(cfg: DecoderConfig, target: TargetSpec, decode_batches: tuple[int, ...] = (),
                     prefill_chunks: tuple[int, ...] = (), speculate: tuple[int, ...] = ()):
    """The decoder's module lowered as our model builds lower (so that kernels key as tuned ones), with each
    Linear's transpose folded into its product (``x @ W.T`` read from W as stored, never copied)."""
    from tvm import relax

    from autosched.pipeline.lowering import lower

    from .cpu_paged_prefill import replace_cpu_paged_prefill

    if prefill_chunks and cfg.rope_scaling.get("rope_type") == "longrope":
        raise UsageError("--prefill-chunks is not supported for a longrope model: it picks its rotary factors from "
                         "a whole prompt's length")
    if any(k < 1 for k in speculate):
        raise UsageError("--speculate takes numbers of proposed tokens, each at least 1 (e.g. --speculate 4)")
    if speculate and (cfg.sliding_window or cfg.rope_scaling.get("rope_type") == "longrope"):
        raise UsageError("--speculate is not supported for a model with a sliding window or longrope: a speculative "
                         "step feeds several tokens past what such a cache can roll back")
    mod, names = export(cfg, target.tvm_target(), decode_batches, prefill_chunks, speculate)
    if target.kind == "llvm":  # TVM's CPU kernels over cached pages are wrong (cpu_paged_prefill says how)
        mod = replace_cpu_paged_prefill(mod, cfg.sliding_window)
    return lower(relax.transform.FuseTransposeMatmul()(mod)), names


def schedule_generation(lowered, db: Database | None, target: TargetSpec, scaled_rope: bool = False):
    """(the scheduled module, report): our database's best records where tasks match, TVM's defaults
    elsewhere (dlight on the GPU; the CPU compiles a kernel as written). ``scaled_rope``: the model's rotation
    is scaled (``rope_scaling``), which TVM's tree-attention kernels inline (see ``attention.TVM_TREE_KERNELS``)."""
    from tvm import tirx

    from autosched.pipeline.build import apply_database

    from .attention import dispatch_attention
    from .cpu_paged_prefill import KERNEL_ATTR, KERNEL_NAME

    lowered, ours, kernels = dispatch_attention(lowered, target, tree_apart=scaled_rope)
    scheduled, applied = apply_database(lowered, db, target, calls=decode_calls(lowered))
    applied.separate.update(kernels)  # compiled on their own and linked, as tuned TIRx kernels are
    report = GenerationReport(tuned=dict(applied.tuned), transferred=dict(applied.transferred),
                              slower_than_default=list(applied.slower_than_default), build_time=list(applied.build_time))
    attention_kernels = {name for names in ATTENTION_ROLES.values() for name in names}
    for gv, func in lowered.functions.items():
        name = gv.name_hint
        if (isinstance(func, tirx.PrimFunc) and name not in report.tuned and name not in report.transferred
                and not name.startswith(tuple(attention_kernels)) and KERNEL_ATTR not in (func.attrs or {})):
            report.default.append(name)
    report.workloads = workload_kernels(lowered, applied, target)
    present = {gv.name_hint: func for gv, func in lowered.functions.items()}
    for role, prefixes in ATTENTION_ROLES.items():
        found = sorted(n for n in present if n.startswith(prefixes))
        mine = [n for n in found if (getattr(present[n], "attrs", None) or {}).get(KERNEL_ATTR)]
        theirs = [n for n in found if n not in mine]
        text = "; ".join([f"autosched {KERNEL_NAME} ({', '.join(mine)})"] * bool(mine)
                         + [f"TVM default ({', '.join(theirs)})"] * bool(theirs))
        report.attention[role] = ours.get(role) or text or "none"
    report.attention.update({role: text for role, text in ours.items() if role not in ATTENTION_ROLES})
    return scheduled, report, applied


def workload_kernels(lowered, applied, target: TargetSpec) -> dict[str, dict[str, str]]:
    """Each kernel of one of our workloads in ``lowered``: its workload's key, the space that serves it on
    ``target`` and its schedule's origin (a database record, the space's default point, or TVM's default
    schedule where an untuned generic GPU space leaves it to dlight)."""
    from tvm import tirx

    from autosched.errors import SpaceError
    from autosched.pipeline.substitute import WORKLOAD_ATTR
    from autosched.pipeline.tasks import task_of

    out = {}
    for gv, func in lowered.functions.items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None or WORKLOAD_ATTR not in func.attrs:
            continue
        task = task_of(gv.name_hint, func)
        try:
            space = task.space(target)
        except SpaceError:
            out[gv.name_hint] = {"workload": task.key, "space": "none", "schedule": "TVM default"}
            continue
        if gv.name_hint in applied.tuned:
            origin = "database"
        elif gv.name_hint in applied.transferred:
            origin = "nearest tuned shape"
        elif not target.is_gpu or space.template:
            origin = "default point"
        else:
            origin = "TVM default (dlight)"
        out[gv.name_hint] = {"workload": task.key, "space": space.name, "schedule": origin}
    return out


def default_decode_batches(max_batch: int) -> tuple[int, ...]:
    """The batch sizes that get a static decode function when none are asked for: the powers of two up to
    ``max_batch``, and it. A static function's kernels are ours (``gemm`` workloads at the spaces' default
    points, or tuned) and on a GPU its step runs as CUDA graphs; the dynamic function's kernels run TVM's
    default schedules for symbolic shapes, far slower at every batch. A batch in between is padded up to the
    next static size (``Generator._padding``)."""
    return tuple(sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch}))


def is_static_function(name: str) -> bool:
    """Whether a generation module's Relax function is one of static shapes (``decode_b<N>``,
    ``prefill_t<T>``, ``verify_b<N>_k<K>``): its kernels are the tunable ones."""
    return name.startswith(("decode_b", "prefill_t", "verify_b"))


def decode_calls(lowered):
    """Kernel name -> calls in one run of each static function."""
    from autosched.pipeline.tasks import kernel_calls

    return kernel_calls(lowered, is_static_function)


# Decode steps per run of a prefill chunk that tuning assumes: a reply of 128 tokens.
DEFAULT_DECODE_STEPS = 128


def check_decode_steps(steps) -> None:
    """``steps``: decode steps per prefill, a whole number, at least 1."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"--decode-steps must be a whole number of steps, at least 1 (got {steps!r}); leave it out "
                         f"for {DEFAULT_DECODE_STEPS}")


def generation_tasks(lowered, decode_steps: int = DEFAULT_DECODE_STEPS) -> list:
    """The tunable kernels of a lowered generation module: those of its static functions (decode steps,
    verify steps and prefill chunks), each distinct kernel once, weighted by its calls over ``decode_steps``
    runs of each decode (and verify) function per run of each prefill chunk: a prompt is prefilled once and
    then decoded token by token, so a decode step's microsecond counts that many times a chunk's (weighed one
    run each, a long chunk's GEMMs, already near the peak, took most of the trials while the decode GEMVs
    far from the copy rate got few). Kernels of symbolic shape (``batch_prefill``, ``batch_decode``) run on
    default schedules."""
    from autosched.pipeline.tasks import extract_tasks

    check_decode_steps(decode_steps)
    return extract_tasks(lowered, is_static_function,
                         lambda name: 1 if name.startswith("prefill_t") else decode_steps)


def small_decode_kernels(lowered, rows: int) -> frozenset[str]:
    """The kernels that decode steps of at most ``rows`` rows call (``decode_b<n>``, n <= rows) and no other
    function does."""
    from autosched.pipeline.tasks import kernel_calls

    def small(name: str) -> bool:
        return name.startswith("decode_b") and name[len("decode_b"):].isdigit() and int(name[len("decode_b"):]) <= rows

    return frozenset(kernel_calls(lowered, small)) - frozenset(kernel_calls(lowered, lambda name: not small(name)))


# Workloads whose kernels read the whole of their weight operand once (a mixture of experts' reads the chosen
# experts' alone, an embedding lookup a row).
WHOLE_WEIGHT_OPS = ("gemm", "dequant_gemm", "swiglu_gemm", "fp8_gemm")


def weight_prefetches(lowered, budget: int, kernels=None) -> dict:
    """{kernel: WeightPrefetch} for each kernel of a static function (of ``kernels`` where given) that is one of
    :data:`WHOLE_WEIGHT_OPS`' workloads and reads a model weight: its blocks' shares of that weight, up to
    ``budget`` bytes in all, asked of L2 before the kernel waits for the one before (:mod:`autosched.pipeline.launch`)."""
    from autosched.pipeline.launch import WeightPrefetch
    from autosched.pipeline.substitute import WORKLOAD_ATTR
    from autosched.pipeline.tasks import weight_inputs
    from autosched.workloads import Workload

    ops = {}
    for gv, func in lowered.functions.items():
        attrs = getattr(func, "attrs", None)
        if attrs is not None and WORKLOAD_ATTR in attrs:
            ops[gv.name_hint] = Workload.from_json(str(attrs[WORKLOAD_ATTR])).op
    return {name: WeightPrefetch(position, budget) for name, position in weight_inputs(lowered, is_static_function).items()
            if ops.get(name) in WHOLE_WEIGHT_OPS and (kernels is None or name in kernels)}


def compile_generation(model: GenerationModel, target: TargetSpec, db: Database | None,
                       decode_batches: tuple[int, ...] = (), cuda_graphs: bool = True,
                       prefill_chunks: tuple[int, ...] = (), speculate: tuple[int, ...] = (),
                       programmatic_launch: bool = False, programmatic_rows: int | None = None,
                       prefetch_weights: int = 0):
    """(executable, the parameter names its functions take in order, report): the decoder lowered, scheduled
    and compiled, without writing anything (``build_generator`` writes it; benchmarks run it in memory).
    On a GPU, the kernels between two attention calls of a static decode function (``decode_batches``) run
    as one captured CUDA graph (TVM's ``RewriteCUDAGraph``): a 32-layer step launches 33 graphs, not 300
    kernels one by one (``cuda_graphs=False`` launches them one by one, to profile each).
    ``programmatic_launch`` (sm_90): every kernel overlaps its launch with the end of the kernel before it
    (:mod:`autosched.pipeline.launch`); with ``programmatic_rows``, only the kernels of decode steps of at
    most that many rows (those no other function calls); with ``prefetch_weights`` (bytes), each GEMM among
    those asks L2 for up to that much of its weights before it waits (:func:`weight_prefetches`)."""
    from autosched.pipeline.build import build_pipeline, compile_separate
    from autosched.target import compile_module

    began = time.perf_counter()
    lowered, names = lower_generation(model.config, target, decode_batches, prefill_chunks, speculate)
    exported = time.perf_counter()
    launch_only = prefetch = None
    if programmatic_launch and programmatic_rows is not None:
        launch_only = small_decode_kernels(lowered, programmatic_rows)
    if programmatic_launch and prefetch_weights:
        prefetch = weight_prefetches(lowered, prefetch_weights, launch_only)
    scaled_rope = model.config.rope_scaling.get("rope_type", "default") != "default"
    scheduled, report, applied = schedule_generation(lowered, db, target, scaled_rope)
    scheduled_at = time.perf_counter()
    config = {"relax.backend.use_cuda_graph": True} if target.is_gpu and cuda_graphs else {}
    executable = compile_module(scheduled, target, config,
                                relax_pipeline=build_pipeline(target, programmatic_launch, launch_only, prefetch))
    executable = compile_separate(executable, applied, target, programmatic_launch, launch_only, prefetch)
    report.seconds = {"export": exported - began, "database": scheduled_at - exported,
                      "compile": time.perf_counter() - scheduled_at}
    return executable, names, report


def generation_manifest(model: GenerationModel, names: list[str], target: TargetSpec, report: GenerationReport,
                        max_seq_len: int, max_batch: int, page_size: int = DEFAULT_PAGE_SIZE,
                        db_path: str | None = None, decode_batches: tuple[int, ...] = (),
                        prefill_chunks: tuple[int, ...] = (), speculate: tuple[int, ...] = ()) -> dict:
    """What a :class:`~autosched.generation.Generator` needs to know of a build, as ``manifest.json`` holds it."""
    import tvm

    from autosched import __version__

    return {
        "format": FORMAT, "version": MANIFEST_VERSION, "model": model.spec, "decoder": model.config.to_json(),
        "param_names": names,
        "param_order": [f"p{i}" for i in range(len(names))], "library": LIBRARY, "params": PARAMS,
        "target": target.to_json(), "max_seq_len": max_seq_len, "max_batch": max_batch, "page_size": page_size,
        "decode_batches": list(decode_batches), "prefill_chunks": list(prefill_chunks),
        "speculate": list(speculate),
        "step_barrier": True,  # decode functions wait for the step before inside the call (barrier.py)
        # A windowed sequence's prefill calls past its first window take up to this many tokens (the windowed
        # cache's prefill kernel masks the cached keys to the window); older builds: one a call.
        "window_chunk": model.config.sliding_window, "eos_token_ids": model.eos_token_ids,
        "autosched_version": __version__, "tvm_version": tvm.__version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "database": db_path,
        **kernel_sources(report), "attention": report.attention,
        "workload_kernels": report.workloads,
        "quantization": manifest_entry(model.config, model.quant_source,
                                       w8a8=any(w["workload"].startswith("fp8_gemm[") for w in report.workloads.values())),
    }


def build_generator(model: GenerationModel, target: TargetSpec, db: Database | None, out_dir: str | Path,
                    max_seq_len: int, max_batch: int, db_path: str | None = None,
                    page_size: int = DEFAULT_PAGE_SIZE,
                    decode_batches: tuple[int, ...] | None = None,
                    prefill_chunks: tuple[int, ...] | None = None,
                    speculate: tuple[int, ...] = (), tokenizer: str | Path | None = None) -> tuple[Path, GenerationReport]:
    """Write a generation artifact for ``model`` to ``out_dir``: ``generate.so`` (batched prefill and decode,
    the KV cache's creation), ``params.bin``, the tokenizer's files of the folder ``tokenizer`` (under
    ``tokenizer/``, for ``autosched serve``) and ``manifest.json``. Nothing is written if the build fails."""
    from autosched.artifact import ARTIFACT_TOKENIZER, tokenizer_files

    check_build_options(max_seq_len, max_batch, decode_batches, prefill_chunks, speculate)
    _check_limits(model.config, max_seq_len, max_batch)
    if model.config.sliding_window >= max_seq_len:  # the window never binds: every layer attends to the whole sequence
        model = replace(model, config=replace(model.config, sliding_window=0, sliding_layers=[]))
    if decode_batches is None:
        decode_batches = default_decode_batches(max_batch)
    if prefill_chunks is None:
        # None unless asked for: which chunk lengths pay off depends on the prompts served (tune-model
        # --generate --prefill-chunks tunes them).
        prefill_chunks = ()
    executable, names, report = compile_generation(model, target, db, decode_batches, prefill_chunks=prefill_chunks,
                                                   speculate=speculate)
    weights = weights_from_hf(model.state if model.state is not None else model.hf.state_dict(), model.config)
    if model.config.quantize:  # round-to-nearest from the float weights, as the kernels read them
        weights = quantize_weights(weights, model.config, model.config.quantize, given=model.prequantized)
    manifest = generation_manifest(model, names, target, report, max_seq_len, max_batch, page_size, db_path,
                                   decode_batches, prefill_chunks, speculate)
    tensors = {key: _to_tvm(weights[name], model.config.dtype) for key, name in zip(manifest["param_order"], names)}
    files = {f"{ARTIFACT_TOKENIZER}/{f.name}": f for f in tokenizer_files(tokenizer)} if tokenizer else {}
    if files:
        manifest["tokenizer"] = ARTIFACT_TOKENIZER
    return write_artifact(out_dir, {LIBRARY: executable}, tensors, manifest, files), report


def check_build_options(max_seq_len: int, max_batch: int, decode_batches: tuple[int, ...] | None = None,
                        prefill_chunks: tuple[int, ...] | None = None, speculate: tuple[int, ...] = ()) -> None:
    """What a generation build's options must be whatever the model: one line each, before the model is loaded
    and exported (seconds to minutes)."""
    for option, value in (("--max-seq-len", max_seq_len), ("--max-batch", max_batch)):
        if value < 1:
            raise UsageError(f"{option} must be at least 1 (got {value})")
    if decode_batches is not None and any(not 1 <= n <= max_batch for n in decode_batches):
        raise UsageError(f"--decode-batches must lie between 1 and --max-batch {max_batch} (got "
                         f"{','.join(map(str, decode_batches))})")
    # A chunk packs the prompts waiting at once (16 prompts of 512 tokens: one chunk of 8192).
    if prefill_chunks is not None and any(not 1 <= t <= max_seq_len * max_batch for t in prefill_chunks):
        raise UsageError(f"--prefill-chunks must lie between 1 and --max-seq-len x --max-batch "
                         f"({max_seq_len * max_batch})")
    if any(k < 1 for k in speculate):
        raise UsageError("--speculate takes numbers of proposed tokens, each at least 1 (e.g. --speculate 4)")


def _check_limits(cfg: DecoderConfig, max_seq_len: int, max_batch: int) -> None:
    dynamic = cfg.rope_scaling.get("max_position_embeddings") if cfg.rope_scaling.get("rope_type") == "dynamic" else None
    if dynamic and max_seq_len > dynamic:
        raise UsageError(f"rotary scaling 'dynamic' is supported up to --max-seq-len {dynamic} (max_position_embeddings): "
                         "past it, transformers recomputes the frequencies from the longest sequence seen so far, "
                         "which a KV cache's keys cannot follow")
    if cfg.sliding_window and max_seq_len > cfg.sliding_window:
        # TVM's sliding window rotates the keys in its attention kernels (the whole head, the default
        # frequencies at one theta): what it cannot do is refused.
        unsupported = window_rope_unsupported(cfg)
        if unsupported:
            raise UsageError(f"a sliding window of {cfg.sliding_window} tokens {unsupported} is not supported for "
                             f"generation yet: use --max-seq-len {cfg.sliding_window} or less")
    if cfg.learned_positions and max_seq_len > cfg.learned_positions:
        raise UsageError(f"the model has {cfg.learned_positions} learned positions: use --max-seq-len "
                         f"{cfg.learned_positions} or less")


def _to_tvm(tensor, dtype: str):
    """A torch tensor as a TVM tensor of ``dtype`` on the CPU (bfloat16 too, which numpy lacks); integer
    tensors (quantised weights' codes) keep their own dtype."""
    import torch
    import tvm

    t = tensor.detach().cpu()
    t = t.to(getattr(torch, dtype)) if t.is_floating_point() else t
    if t.dtype != torch.bfloat16:
        return tvm.runtime.tensor(t.contiguous().numpy())
    # A fresh copy: DLPack import needs 64-byte aligned data, which a view into a state dict may not be.
    return tvm.runtime.from_dlpack(t.clone(memory_format=torch.contiguous_format)).copyto(tvm.cpu())
