"""The deployable artifacts, both kinds: a model build (``autosched build``: ``model.so``, or a library per
bucket) and a generation build (``autosched build --generate``: ``generate.so``), each beside ``params.bin`` and
``manifest.json``. One writer (:func:`write_artifact`) and one manifest reader (:func:`read_manifest`, by
kind) for both, loadable with TVM's runtime alone: nothing here imports a build module."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from autosched.errors import UsageError

if TYPE_CHECKING:
    from autosched.pipeline.build import ApplyReport
    from autosched.pipeline.load import Model
    from autosched.target import TargetSpec


MANIFEST = "manifest.json"
LIBRARY = "model.so"
PARAMS = "params.bin"
MANIFEST_VERSION = 1  # what export_artifact, export_bucketed and the generation build write
MODEL_FORMAT = "autosched-model"  # the format of `build`'s manifest
GENERATION_FORMAT = "autosched-generator"  # the format of `build --generate`'s manifest
GENERATION_LIBRARY = "generate.so"


# Called with the name of each step of :func:`write_artifact` once it is done (``params.bin``, each library's file
# name, ``manifest.json``), and with ``swap`` just before the new folder takes the target's place: tests
# interrupt a build there (SIGINT, as Ctrl-C sends it) to check what an interrupted write leaves.
WRITE_HOOK: Callable[[str], None] | None = None
# The folders a write stages into beside the target, and the one an earlier build moves to while the new one
# takes its place: ``.NAME.autosched-partial-PID-XXXX`` and ``.NAME.autosched-old-PID-XXXX``.
PARTIAL, OLD = "autosched-partial", "autosched-old"


# The files of a Hugging Face tokenizer that ``build --generate`` copies into the artifact (those present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json")
ARTIFACT_TOKENIZER = "tokenizer"  # the artifact's subfolder


# The files one of which a Hugging Face tokenizer's folder holds (a fast tokenizer's, or a slow one's vocabulary).
TOKENIZER_MARKS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_MARKS)


def tokenizer_files(folder: str | Path) -> list[Path]:
    """The tokenizer's files in ``folder`` (a model's or a tokenizer's), those ``build --generate`` copies; none
    where it holds no tokenizer."""
    folder = Path(folder)
    if not folder.is_dir() or not has_tokenizer(folder):
        return []
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


def write_artifact(out_dir: str | Path, libraries: dict, params: dict, manifest: dict,
                   files: dict | None = None) -> Path:
    """Write an artifact of either kind, all or nothing: ``params`` ({name: TVM tensor}) to ``params.bin``, each
    executable of ``libraries`` ({file name: executable}), ``files`` ({path in the artifact: file to copy}, e.g.
    the tokenizer's) and ``manifest.json`` into a new folder beside
    ``out_dir``, which then takes the place of ``out_dir`` (an earlier build there is replaced whole). An
    interrupted or failed write leaves ``out_dir`` as it was; a folder staged by a run that was killed is
    removed by the next write. The manifest gains each file's size (and a library's sha256) and each
    parameter's shape and dtype, which the loaders check before they read the files."""
    import tvm

    out = Path(out_dir)
    target = Path(os.path.abspath(out))
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(target)
    staging = _staging_folder(target)
    try:
        blob = tvm.runtime.save_param_dict(params)
        (staging / PARAMS).write_bytes(blob)
        _reached(PARAMS)
        for name, executable in libraries.items():
            executable.export_library(str(staging / name))
            _reached(name)
        for name, source in (files or {}).items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, staging / name)
        files = {PARAMS: {"bytes": len(blob)}, **{name: file_facts(staging / name) for name in libraries}}
        shapes = {name: [[int(d) for d in t.shape], str(t.dtype)] for name, t in params.items()}
        (staging / MANIFEST).write_text(json.dumps({**manifest, "files": files, "param_shapes": shapes}, indent=2))
        _reached(MANIFEST)
        _reached("swap")
        _swap_in(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _reached(step: str) -> None:
    if WRITE_HOOK is not None:
        WRITE_HOOK(step)


def file_facts(path: Path) -> dict:
    """A library's size and sha256, as the manifest records them."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _staging_folder(target: Path) -> Path:
    """A new folder to write the artifact into: beside ``target``, or inside it where its parent may not be
    written (a folder made for the user in a read-only place)."""
    unique = f"{PARTIAL}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        staging = target.parent / f".{target.name}.{unique}"
        staging.mkdir()  # as any new folder (the umask's mode), not private as a temporary one
    except PermissionError:
        if not target.is_dir():
            raise UsageError(f"cannot write the artifact: {target.parent} may not be written") from None
        staging = target / f".{unique}"
        staging.mkdir()
    return staging


def _remove_leftovers(target: Path) -> None:
    """Folders that an earlier write to ``target`` staged or moved aside and, killed, never removed."""
    places = [(target.parent, f".{target.name}."), (target, ".")]
    for folder, prefix in places:
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            for kind in (PARTIAL, OLD):
                if entry.name.startswith(f"{prefix}{kind}-") and entry.is_dir() and not entry.is_symlink():
                    pid = entry.name[len(f"{prefix}{kind}-"):].split("-")[0]
                    if pid.isdigit() and not _alive(int(pid)):
                        shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True


def _swap_in(staging: Path, target: Path) -> None:
    """Put the folder ``staging`` in ``target``'s place: renamed there where nothing is, else the earlier folder
    renamed aside, ``staging`` renamed in, the earlier one removed. Ctrl-C and SIGTERM wait until the renames
    are done (an interrupt then finds the new build whole). Where this process works inside ``target`` (a
    rename would leave it in a removed folder), or ``staging`` is inside it, the files are moved in instead,
    the earlier manifest first removed and the new one moved last."""
    blocked = _hold_interrupts()
    try:
        if staging.parent == target:
            return _move_files(staging, target)
        if not os.path.lexists(target):
            os.rename(staging, target)
            return None
        cwd = os.getcwd()
        if os.path.commonpath([cwd, os.path.realpath(target)]) == os.path.realpath(target):
            return _move_files(staging, target)
        old = target.parent / f".{target.name}.{OLD}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(target, old)
        except OSError:  # a mount point, say: the files move instead
            return _move_files(staging, target)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)
            raise
    finally:
        if blocked is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    shutil.rmtree(old, ignore_errors=True)
    return None


def _move_files(staging: Path, target: Path) -> None:
    (target / MANIFEST).unlink(missing_ok=True)  # until the new manifest is in, the folder is no build
    for item in staging.iterdir():
        if item.name != MANIFEST:
            os.replace(item, target / item.name)
    os.replace(staging / MANIFEST, target / MANIFEST)
    staging.rmdir()


def _hold_interrupts():
    """Block SIGINT and SIGTERM in this thread (the old mask, to restore), or None where that cannot be done."""
    try:
        return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    except (AttributeError, ValueError, OSError):
        return None


def export_artifact(out_dir: str | Path, executable, params: list, model: Model, target: TargetSpec,
                    report: ApplyReport, db_path: str | None) -> Path:
    """Write ``model.so``, ``params.bin`` and ``manifest.json`` to ``out_dir``."""
    manifest = _manifest(model, target, db_path)
    tensors = _named(params)
    manifest.update(param_order=list(tensors), library=LIBRARY, **kernel_sources(report))
    return write_artifact(out_dir, {LIBRARY: executable}, tensors, manifest)


def export_bucketed(out_dir: str | Path, executables: dict, params: dict, model: Model, target: TargetSpec,
                    reports: dict, axes: dict, db_path: str | None) -> Path:
    """A build of several buckets, (batch, tokens) pairs: one library per bucket (``model-t128.so``,
    ``model-b4.so``, ``model-b4-t128.so``), one parameter file holding each distinct tensor once
    (``param_order`` per bucket), and a manifest saying which axis of each input and output is the
    batch and the sequence. ``axes``: {"batch" and/or "tokens": PaddedAxes}, the axes that vary."""
    from autosched.buckets import bucket_key

    manifest = _manifest(model, target, db_path)
    buckets = sorted(executables, key=lambda b: (b[0] or 0, b[1] or 0))
    # Each tensor once: build_buckets made a tensor shared by several buckets one object.
    distinct = list({id(t): t for bucket in params.values() for t in bucket}.values())
    tensors = _named(distinct)
    names = dict(zip(map(id, distinct), tensors))
    manifest["param_order"] = {bucket_key(b): [names[id(t)] for t in params[b]] for b in buckets}
    for axis, found in axes.items():
        for spec, index in zip(manifest["inputs"], found.inputs):
            if index is not None:
                spec["shape"][index] = axis
        manifest["model_kwargs"].pop(axis, None)
        manifest[f"{'token' if axis == 'tokens' else axis}_axes"] = {"inputs": found.inputs, "outputs": found.outputs}
    # Lengths alone: the buckets as lengths, as such builds have always written them.
    listed = [b[1] for b in buckets] if "batch" not in axes else [list(b) for b in buckets]
    manifest.update(buckets=listed, libraries={bucket_key(b): _library(b) for b in buckets},
                    kernels_per_bucket={bucket_key(b): kernel_sources(reports[b]) for b in buckets})
    return write_artifact(out_dir, {_library(b): executables[b] for b in buckets}, tensors, manifest)


def _library(bucket) -> str:
    from autosched.buckets import bucket_key

    key = bucket_key(bucket)
    return f"model-{key if key.startswith('b') else 't' + key}.so"


def kernel_sources(report: ApplyReport) -> dict:
    """The manifest's record of where each kernel's schedule came from: tuned, transferred or default."""
    return {"tuned_kernels": report.tuned, "transferred_kernels": report.transferred,
            "default_kernels": report.default, "build_time_kernels": report.build_time,
            "records_slower_than_default": report.slower_than_default}


def _named(tensors: list) -> dict:
    """``tensors`` named as ``params.bin`` holds them: ``p0``, ``p1``, ..."""
    return {f"p{i}": t for i, t in enumerate(tensors)}


def _manifest(model: Model, target: TargetSpec, db_path: str | None) -> dict:
    """The manifest's fields every model build has."""
    import tvm

    from autosched import __version__

    return {
        "format": MODEL_FORMAT, "version": MANIFEST_VERSION, "model": model.spec, "model_kwargs": dict(model.kwargs),
        "autosched_version": __version__,
        "tvm_version": tvm.__version__, "target": target.to_json(), "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "params": PARAMS, "inputs": model.input_specs(), "weights_sha256": model.weights_digest(), "database": db_path,
    }


def read_manifest(out_dir: str | Path, kind: str = "model") -> dict:
    """The manifest of an artifact of ``kind`` (``model``: ``autosched build``; ``generation``: ``autosched build
    --generate``), checked: it parses, is of that kind and a version this autosched reads, has the fields a
    load needs, and the files it names are there (a damaged artifact is named in one line, not met later as
    a TVM or KeyError)."""
    generation = kind == "generation"
    build = "`autosched build MODEL --generate`" if generation else "`autosched build`"
    rebuild = f"rebuild it with {build}"
    manifest_path = Path(out_dir) / MANIFEST
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise UsageError(f"{out_dir} is a file, not an artifact: give the folder {build[:-1]} -o DIR` wrote")
    if not Path(out_dir).is_dir():
        raise UsageError(f"no folder {out_dir} (so no {MANIFEST}): give the folder {build[:-1]} -o DIR` wrote")
    if not manifest_path.exists():
        raise UsageError(f"{out_dir} is not an autosched build (no {MANIFEST}): run {build[:-1]} -o {out_dir}` first")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{manifest_path} is not valid JSON ({exc.msg}, line {exc.lineno}): {rebuild}") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise UsageError(f"{manifest_path} cannot be read ({exc}): {rebuild}") from None
    if not isinstance(manifest, dict):
        raise UsageError(f"{manifest_path} is not an autosched manifest (not a JSON object): {rebuild}")
    if generation and manifest.get("format") != GENERATION_FORMAT:
        raise UsageError(f"{out_dir} was built without --generate: rebuild it with {build}")
    if not generation and manifest.get("format") == GENERATION_FORMAT:
        raise UsageError(f"{out_dir} is a generation artifact (built with --generate): generate from it with "
                         f"`autosched generate {out_dir} --prompt-ids 1,2,3` or autosched.Generator")
    check_manifest_version(manifest, manifest_path)
    if generation:
        need = ["target", "decoder", "library", "params", "param_order", "max_seq_len", "max_batch", "page_size"]
    else:
        need = ["model", "target", "inputs", "params", "param_order"] + (
            ["libraries", "kernels_per_bucket"] if "buckets" in manifest else ["library", "tuned_kernels", "default_kernels"])
    missing = [key for key in need if key not in manifest]
    if missing:
        raise UsageError(f"{manifest_path} lacks {', '.join(missing)}: {rebuild}")
    _check_fields(manifest, manifest_path, GENERATION_FIELDS if generation else MODEL_FIELDS, rebuild)
    libraries = list(manifest["libraries"].values()) if "buckets" in manifest else [manifest["library"]]
    for name in [*libraries, manifest["params"]]:
        if not (Path(out_dir) / name).is_file():
            raise UsageError(f"{Path(out_dir) / name} is missing (named by {manifest_path}): {rebuild}")
    _check_files(Path(out_dir), manifest, libraries, rebuild)
    return manifest


# What each manifest field a load reads must be, by kind (fields in ``a.b`` form are inside an object). A
# bucketed build's param_order is an object of lists, checked apart.
GENERATION_FIELDS = {"target": "object", "target.kind": "name", "decoder": "object", "decoder.vocab": "count",
                     "decoder.layers": "count", "library": "name", "params": "name", "param_order": "names",
                     "max_seq_len": "count", "max_batch": "count", "page_size": "count", "decode_batches": "counts",
                     "prefill_chunks": "counts", "speculate": "counts", "eos_token_ids": "ids", "files": "object",
                     "param_shapes": "object"}
MODEL_FIELDS = {"model": "name", "target": "object", "target.kind": "name", "inputs": "objects", "params": "name",
                "library": "name", "tuned_kernels": "object", "default_kernels": "list", "libraries": "object",
                "kernels_per_bucket": "object", "buckets": "list", "files": "object", "param_shapes": "object"}
_KINDS = {"count": "a whole number, at least 1", "id": "a whole number, 0 or more", "name": "a name (text)",
          "object": "a JSON object", "list": "a list", "counts": "a list of whole numbers, each at least 1",
          "ids": "a list of whole numbers, 0 or more", "names": "a list of names", "objects": "a list of JSON objects"}


def _fits(kind: str, value) -> bool:
    if kind in ("count", "id"):
        return isinstance(value, int) and not isinstance(value, bool) and value >= (1 if kind == "count" else 0)
    if kind == "name":
        return isinstance(value, str) and bool(value)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list)
    one = {"counts": "count", "ids": "id", "names": "name", "objects": "object"}[kind]
    return isinstance(value, list) and all(_fits(one, v) for v in value)


def _check_fields(manifest: dict, manifest_path: Path, fields: dict, rebuild: str) -> None:
    """A field of the wrong type (``"max_batch": "x"``) is named in one line, not met later as a TypeError."""
    checks = dict(fields)
    if "buckets" in manifest:  # a bucketed build: param_order by bucket, and a library per bucket
        checks["param_order"] = "object"
    else:
        checks["param_order"] = "names"
    for key, kind in checks.items():
        holder, field = manifest, key
        if "." in key:
            outer, field = key.split(".", 1)
            holder = manifest.get(outer)
            if not isinstance(holder, dict):
                continue
        if field in holder and not _fits(kind, holder[field]):
            raise UsageError(f"{manifest_path}: {key} is {json.dumps(holder[field])[:40]}, not {_KINDS[kind]}: {rebuild}")
    for key in ("param_order", "libraries"):
        for name, value in (manifest.get(key) or {}).items() if isinstance(manifest.get(key), dict) else ():
            if not _fits("names" if key == "param_order" else "name", value):
                raise UsageError(f"{manifest_path}: {key}.{name} is {json.dumps(value)[:40]}, not "
                                 f"{_KINDS['names' if key == 'param_order' else 'name']}: {rebuild}")


def _check_files(out: Path, manifest: dict, libraries: list, rebuild: str) -> None:
    """Each file's size, and each library's sha256, against what the build recorded (builds from before they
    were recorded are not checked): a library cut short or of another build is refused before it is loaded
    (TVM's loader would map it, and the process die of SIGBUS where it reads past its end), a parameter file
    of another build before it is read."""
    files = manifest.get("files") or {}
    for name in [*libraries, manifest["params"]]:
        facts, path = files.get(name), out / name
        if not isinstance(facts, dict):
            continue
        size, recorded = path.stat().st_size, facts.get("bytes")
        if isinstance(recorded, int) and size != recorded:
            raise UsageError(f"{path} is {size} bytes, not the {recorded} that {MANIFEST} records (cut short, or "
                             f"the file of another build): {rebuild}")
        if name in libraries and isinstance(facts.get("sha256"), str) and file_facts(path)["sha256"] != facts["sha256"]:
            raise UsageError(f"{path} is not the library this build wrote (its sha256 differs from the one {MANIFEST} "
                             f"records: damaged, or of another build): {rebuild}")


def check_elf(path: Path, rebuild: str) -> None:
    """A shared library shorter than its ELF header says (a truncated copy, in a build too old to record its
    size) is refused before the loader maps it and the process dies of SIGBUS reading past its end."""
    import struct

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
            return  # not ELF: TVM's loader says what it is
        wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
        phoff, shoff = struct.unpack_from(order + ("QQ" if wide else "II"), head, 0x20 if wide else 0x1C)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36 if wide else 0x2A)
        end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
        if end <= size:
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(phnum):
                if wide:
                    _, _, offset, _, _, filesz = struct.unpack_from(order + "IIQQQQ", table, i * phentsize)
                else:
                    _, offset, _, _, filesz = struct.unpack_from(order + "IIIII", table, i * phentsize)
                end = max(end, offset + filesz)
    if end > size:
        raise UsageError(f"{path} is cut short ({size} bytes of the {end} its ELF header describes: a truncated "
                         f"copy?): {rebuild}")


def check_param_shapes(path: Path, saved: dict, manifest: dict, names: list, rebuild: str) -> None:
    """Each parameter's shape and dtype against what the build recorded (where it did): a parameter file of
    another build or model is refused in one line, not met as a TVM error at the first call."""
    shapes = manifest.get("param_shapes")
    if not isinstance(shapes, dict):
        return
    for name in names:
        want, tensor = shapes.get(name), saved.get(name)
        if tensor is None or not isinstance(want, list):
            continue
        got = [[int(d) for d in tensor.shape], str(tensor.dtype)]
        if got != want:
            raise UsageError(f"{path} is not this build's: its parameter {name} is {got[1]}{got[0]} where {MANIFEST} "
                             f"says {want[1]}{want[0]} (the parameters of another build or model?): {rebuild}")


def check_manifest_version(manifest: dict, manifest_path: Path) -> None:
    """A manifest of a version this autosched does not read is refused in one line (an older manifest has no
    version: 1)."""
    version = manifest.get("version", MANIFEST_VERSION)
    if version != MANIFEST_VERSION:
        by = f" (autosched {manifest['autosched_version']} wrote it)" if manifest.get("autosched_version") else ""
        raise UsageError(f"{manifest_path} is of manifest version {version!r}{by} and this autosched reads version "
                         f"{MANIFEST_VERSION}: rebuild the artifact with this autosched, or use the one that built it")


def load_library(path: Path, rebuild: str = "rebuild it with `autosched build`"):
    """A compiled library of an artifact; one that TVM cannot load (empty, damaged) is a UsageError naming it
    and the reason."""
    import tvm

    check_elf(path, rebuild)
    try:
        return tvm.runtime.load_module(str(path))
    except Exception as exc:  # noqa: BLE001 - TVM raises its own error types for a damaged file
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise UsageError(f"{path} cannot be loaded ({reason}): {rebuild}") from None



def load_params(path: Path, rebuild: str = "rebuild it with `autosched build`") -> dict:
    """Every tensor of a parameter file, by name (on the host); a damaged file is a UsageError naming it."""
    import tvm

    try:
        return tvm.runtime.load_param_dict(path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - TVM's error for a damaged parameter file
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise UsageError(f"{path} cannot be read as parameters ({reason}): {rebuild}") from None


def _saved_params(out: Path, manifest: dict, device) -> dict:
    """Every tensor of ``params.bin``, by name, on ``device``."""
    saved = load_params(out / manifest["params"])
    check_param_shapes(out / manifest["params"], saved, manifest, list(saved), "rebuild it with `autosched build`")
    return {name: t.copyto(device) for name, t in saved.items()}


def artifact_device(manifest: dict, path: str | Path):
    """The device an artifact's kernels run on; a DeviceError in one line where this machine has none (a
    build for ``cuda:sm_90`` made on a machine without a GPU, say)."""
    import tvm

    from autosched.errors import DeviceError
    from autosched.target import KIND_FACTS, use_all_cpu_threads

    target = manifest["target"]
    if target["kind"] not in KIND_FACTS:
        raise UsageError(f"{path} was built for target kind {target['kind']!r}, which this autosched does not know "
                         f"(it knows {', '.join(KIND_FACTS)}): rebuild it")
    if target["kind"] == "llvm":
        use_all_cpu_threads()  # as the kernels were tuned and timed
    device = tvm.device(KIND_FACTS[target["kind"]].device, 0)
    if not device.exist:
        raise DeviceError(f"{path} was built for {target['kind']}:{target.get('arch', '?')} and this machine has no such "
                          f"device: run it on a machine with one, or build it again with --target llvm")
    return device


def load_generation_artifact(out_dir: str | Path):
    """(executable, params on the device in ``param_order``, manifest, device) of a ``build --generate``
    artifact, using TVM's runtime only."""
    out, manifest = Path(out_dir), read_manifest(out_dir, "generation")
    rebuild = "rebuild the artifact with `autosched build MODEL --generate`"
    device = artifact_device(manifest, out)
    executable = load_library(out / manifest["library"], rebuild)
    saved = load_params(out / manifest["params"], rebuild)
    missing = [name for name in manifest["param_order"] if name not in saved]
    if missing:
        raise UsageError(f"{out / manifest['params']} lacks {len(missing)} of the {len(manifest['param_order'])} "
                         f"parameters {MANIFEST} names (a truncated file, or another build's?): {rebuild}")
    check_param_shapes(out / manifest["params"], saved, manifest, manifest["param_order"], rebuild)
    return executable, [saved[name].copyto(device) for name in manifest["param_order"]], manifest, device


def load_artifact(out_dir: str | Path):
    """(VirtualMachine, params, manifest) of an exported artifact, using TVM's runtime only. A
    ``--tokens dynamic`` build is loaded by :class:`BucketedModel` instead."""
    from tvm import relax

    out, manifest = Path(out_dir), read_manifest(out_dir)
    if "buckets" in manifest:
        raise UsageError(f"{out} is a --tokens dynamic build: load it with autosched.pipeline.BucketedModel")
    device = artifact_device(manifest, out)
    vm = relax.VirtualMachine(load_library(out / manifest["library"]), device)
    saved = _saved_params(out, manifest, device)
    return vm, [saved[name] for name in manifest["param_order"]], manifest


class BucketedModel:
    """A ``--tokens dynamic`` and/or ``--batch dynamic`` build, with TVM's runtime and numpy only:
    ``model(*inputs)`` pads each input along its sequence and batch axes to the smallest bucket that
    holds it (token ids with the lowest id of their range, other inputs with zeros), runs that bucket's
    module and cuts the outputs back. Exact for the models the build accepts (causal, and sequences of
    a batch independent)."""

    def __init__(self, out_dir: str | Path):
        self.path, self.manifest = Path(out_dir), read_manifest(out_dir)
        if "buckets" not in self.manifest:
            raise UsageError(f"{out_dir} was built for one shape: load it with autosched.pipeline.load_artifact")
        listed = self.manifest["buckets"]
        # (batch, tokens) pairs; a build of lengths alone lists lengths
        self.buckets: list[tuple] = [tuple(b) if isinstance(b, list) else (None, b) for b in listed]
        self.axes = {axis: self.manifest[key] for axis, key in (("batch", "batch_axes"), ("tokens", "token_axes"))
                     if key in self.manifest}
        self.device = artifact_device(self.manifest, self.path)
        self._tensors = _saved_params(self.path, self.manifest, self.device)  # once, however many buckets take each
        self._vms: dict[tuple, object] = {}

    def key(self, bucket: tuple) -> str:
        """The bucket's name in the manifest."""
        from autosched.buckets import bucket_key

        return bucket_key(bucket)

    def params(self, bucket: tuple) -> list:
        """The parameters the bucket's ``main`` takes after its inputs."""
        return [self._tensors[name] for name in self.manifest["param_order"][self.key(bucket)]]

    def bucket(self, tokens: int | None = None, batch: int | None = None) -> tuple:
        """The bucket, a (batch, tokens) pair, for inputs of ``tokens`` tokens and ``batch`` sequences
        (None: the largest bucket along that axis)."""
        from .buckets import bucket_for

        chosen = []
        for index, (axis, size) in enumerate((("batch", batch), ("tokens", tokens))):
            sizes = sorted({b[index] for b in self.buckets if b[index] is not None})
            if not sizes:
                chosen.append(None)
            else:
                chosen.append(sizes[-1] if size is None else bucket_for(sizes, size, axis))
        return tuple(chosen)

    def vm(self, bucket: tuple):
        """The virtual machine of one bucket, loaded on first use."""
        from tvm import relax

        if bucket not in self._vms:
            library = self.path / self.manifest["libraries"][self.key(bucket)]
            self._vms[bucket] = relax.VirtualMachine(load_library(library), self.device)
        return self._vms[bucket]

    def sizes_of(self, inputs) -> tuple:
        """(batch, tokens) of ``inputs``, None along an axis the build does not vary."""
        def size(axis):
            if axis not in self.axes:
                return None
            return next(x.shape[a] for x, a in zip(inputs, self.axes[axis]["inputs"]) if a is not None)

        return size("batch"), size("tokens")

    def padded(self, inputs, bucket: tuple) -> list:
        """The inputs (numpy arrays) padded to ``bucket``, as TVM tensors on the model's device."""
        import numpy as np
        import tvm

        out = []
        for i, (x, spec) in enumerate(zip(inputs, self.manifest["inputs"])):
            x = np.asarray(x)
            widths = [(0, 0)] * x.ndim
            for axis, target in zip(("batch", "tokens"), bucket):
                index = self.axes[axis]["inputs"][i] if axis in self.axes else None
                if index is not None and x.shape[index] < target:
                    widths[index] = (0, target - x.shape[index])
            if any(w != (0, 0) for w in widths):
                x = np.pad(x, widths, constant_values=(spec.get("range") or [0])[0])
            out.append(tvm.runtime.tensor(np.ascontiguousarray(x), self.device))
        return out

    def cut(self, outputs, sizes: tuple) -> list:
        """The outputs cut back to ``sizes``, (batch, tokens), along their axes (numpy arrays)."""
        cut = []
        for i, o in enumerate(outputs):
            o = o.numpy()
            for axis, size in zip(("batch", "tokens"), sizes):
                index = self.axes[axis]["outputs"][i] if axis in self.axes else None
                if index is not None:
                    o = o.take(range(size), axis=index)
            cut.append(o)
        return cut

    def __call__(self, *inputs) -> list:
        sizes = self.sizes_of(inputs)
        bucket = self.bucket(tokens=sizes[1], batch=sizes[0])
        out = self.vm(bucket)["main"](*self.padded(inputs, bucket), *self.params(bucket))
        outputs = [out] if hasattr(out, "numpy") else [out[i] for i in range(len(out))]
        return self.cut(outputs, sizes)
