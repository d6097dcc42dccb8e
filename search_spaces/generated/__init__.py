"""Generated TensorIR schedule spaces: each point is a schedule (tiling, binding, vectorisation, ...) that
TVM's ``s_tir.Schedule`` applies to the workload's own TensorIR function."""
