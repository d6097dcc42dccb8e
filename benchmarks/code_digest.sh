#!/usr/bin/env bash
# A digest of the project's code (Python, shell, TOML and CUDA files under the code folders): the GPU runs
# print it, and the same command in a checkout says which commit's code they ran.
cd "$(dirname "$0")/.." && find autosched search_spaces database examples tests benchmarks pyproject.toml \
  -type f \( -name '*.py' -o -name '*.sh' -o -name '*.toml' -o -name '*.cuh' -o -name '*.cu' \) -not -path '*/__pycache__/*' | LC_ALL=C sort \
  | xargs sha256sum | sha256sum | cut -c1-16
