"""Kernel templates with knobs (sm_90a): each point is a whole kernel, written here as TIRx around CUDA
sources in ``cuda/``, that replaces the workload's TensorIR function. ``_hopper.py`` holds what they share."""
