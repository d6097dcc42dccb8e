"""Whole models: PyTorch -> Relax -> fused TensorIR kernels -> tuned -> a deployable module.

1. **Import**: ``torch.export`` and TVM's ``from_exported_program``, weights kept as parameters, in
   torch's dtypes. Where our workloads beat what legalisation produces, they are substituted: each
   RMSNorm becomes our ``rmsnorm`` kernel, each scaled-dot-product attention our ``attention`` kernel
   (fused flash attention on the GPU) and, on the GPU, each Linear our ``gemm`` kernel on the weight as
   stored (on the CPU, weights are transposed once, at build time, to the layout its space prefers).
2. **Lower** (:func:`lowering`): legalise operators to TensorIR, fold constants, fuse operators
   (``FuseOps``/``FuseTIR``: elementwise chains such as SwiGLU's, RoPE's or a residual add become one
   kernel), turn reshapes of contiguous tensors into views and drop dead code. Extraction and
   application of the database both run exactly this prefix, so the kernels' keys match.
3. **Extract**: every distinct kernel becomes a :class:`~autosched.task.Task`, deduplicated by structural
   hash and weighted by how often the model calls it.
4. **Tune**: one trial budget spread over the tasks by the task scheduler (:func:`~autosched.tuner.tune_tasks`).
5. **Apply**: each kernel gets the best record for its key and target; kernels without one get dlight's
   default schedule on the GPU, or their space's default point on the CPU, so an untuned model builds.
6. **Export**: ``export_library`` of the compiled module, the parameters, and a manifest; the artifact
   loads with TVM's runtime alone.
"""

from __future__ import annotations

from ..artifact import LIBRARY, MANIFEST, PARAMS, BucketedModel, export_artifact, export_bucketed, load_artifact, read_manifest
from .build import ApplyReport, apply_database, build_buckets, build_model, build_pipeline, build_summary, compile_separate
from .importer import import_model
from .lengths import bucket_grid, bucket_key, check_padding_is_exact, models_at, parse_batches, parse_lengths
from .load import Model, load_model
from .lowering import lower, lowering, prepare, transform_params
from .substitute import WORKLOAD_ATTR, substitute_workloads
from .tasks import extract_tasks, kernel_calls, merge_bucket_tasks, split_tunable, task_of

__all__ = [
    "ApplyReport", "BucketedModel", "LIBRARY", "MANIFEST", "Model", "PARAMS", "WORKLOAD_ATTR",
    "apply_database", "bucket_grid", "bucket_key", "build_buckets", "build_model", "build_pipeline",
    "build_summary", "check_padding_is_exact", "compile_separate", "export_artifact", "export_bucketed",
    "extract_tasks", "import_model", "kernel_calls", "load_artifact", "load_model", "lower", "lowering",
    "merge_bucket_tasks", "models_at", "parse_batches", "parse_lengths", "prepare", "read_manifest", "split_tunable",
    "substitute_workloads", "task_of", "transform_params",
]
