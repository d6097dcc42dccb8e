# Sourced by the GPU-machine scripts of benchmarks/: makes the environment they need, or says in one line what
# is missing and stops. On the GPU machine TVM and our other dependencies come from .gpu/ (made here by
# ../shared/tools/gpu-pack; its TVM staged there by `bash .gpu/tvm/stage.sh` in the call before); anywhere
# autosched is installed (`pip install -e '.[test]'`) nothing needs staging.
export PYTHONUNBUFFERED=1 CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export OUT=${OUT:-$PWD/.bench/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # a plain checkout imports as autosched (autosched/_checkout.py)
if [[ -f .gpu/deps/setup.sh ]] && ! python3 -c "import tvm" 2>/dev/null; then
  # shellcheck disable=SC1091
  source .gpu/deps/setup.sh > "$OUT/gpu_env.log" 2>&1
fi
# NEED: more "module=what to install" pairs, space-separated, that the calling script needs.
# shellcheck disable=SC2086
missing=$(python3 - ${NEED:-} <<'PY' 2>/dev/null || echo "python3"
import importlib, importlib.util, sys
need = {"tvm": "TVM 0.27 (../shared/tools/gpu-pack here, then `bash .gpu/tvm/stage.sh` on the GPU machine)",
        "torch": "torch", "sqlalchemy": "SQLAlchemy (.gpu/deps)", "xgboost": "xgboost (.gpu/deps)",
        "alembic": "alembic (.gpu/deps)"}
need.update({name: spec for name, spec in (a.split("=", 1) for a in sys.argv[1:])})
def missing(name):  # imported, not only found: a package whose own dependency is missing fails here
    try:
        importlib.import_module(name)
    except ImportError as exc:
        return f"{text} ({exc})" if (text := need[name]) and importlib.util.find_spec(name) else text
    return None
print("; ".join(filter(None, map(missing, need))))
PY
)
if [[ -n $missing ]]; then
  echo "missing on this machine: $missing" >&2
  exit 2
fi
command -v nvidia-smi > /dev/null || { echo "missing on this machine: a CUDA GPU (nvidia-smi)" >&2; exit 2; }
