# rmsnorm[m=2048,n=4096]:float32;eps=1e-05: autosched 64 trials
# from tvm.script import ir as I
# from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def main(X: T.Buffer((2048, 4096), "float32"), W: T.Buffer((4096,), "float32"), norm: T.Buffer((2048, 4096), "float32")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        sumsq = T.sblock_alloc_buffer((2048,))
        rstd = T.sblock_alloc_buffer((2048,))
        sumsq_rf = T.sblock_alloc_buffer((2048, 16))
        for i_0 in T.parallel(256):
            for i_1 in range(8):
                for ax2, ax1, ax0_0 in T.grid(256, 1, 1):
                    for ax0_1 in T.vectorized(16):
                        with T.sblock("sumsq_rf"):
                            vk_1 = T.axis.spatial(16, ax0_0 * 16 + ax0_1)
                            v_i = T.axis.spatial(2048, i_0 * 8 + i_1 + ax1)
                            vk_0 = T.axis.reduce(256, ax2)
                            T.reads(X[v_i, vk_0 * 16 + vk_1])
                            T.writes(sumsq_rf[v_i, vk_1])
                            T.sblock_attr({"pragma_auto_unroll_max_step": 64, "pragma_unroll_explicit": 1})
                            with T.init():
                                sumsq_rf[v_i, vk_1] = T.float32(0.0)
                            sumsq_rf[v_i, vk_1] = sumsq_rf[v_i, vk_1] + X[v_i, vk_0 * 16 + vk_1] * X[v_i, vk_0 * 16 + vk_1]
                for ax0, ax1 in T.grid(16, 1):
                    with T.sblock("sumsq"):
                        vk_1 = T.axis.reduce(16, ax0)
                        v_i = T.axis.spatial(2048, i_0 * 8 + i_1 + ax1)
                        T.reads(sumsq_rf[v_i, vk_1])
                        T.writes(sumsq[v_i])
                        T.sblock_attr({"pragma_auto_unroll_max_step": 64, "pragma_unroll_explicit": 1})
                        with T.init():
                            sumsq[v_i] = T.float32(0.0)
                        sumsq[v_i] = sumsq[v_i] + sumsq_rf[v_i, vk_1]
                for ax0 in range(1):
                    with T.sblock("rstd"):
                        v_i = T.axis.spatial(2048, i_0 * 8 + i_1 + ax0)
                        T.reads(sumsq[v_i])
                        T.writes(rstd[v_i])
                        T.sblock_attr({"pragma_auto_unroll_max_step": 64, "pragma_unroll_explicit": 1})
                        rstd[v_i] = T.rsqrt(sumsq[v_i] / T.float32(4096.0) + T.float32(1.0000000000000001e-05))
                for j_0 in range(256):
                    for j_1 in T.vectorized(16):
                        with T.sblock("norm"):
                            v_i = T.axis.spatial(2048, i_0 * 8 + i_1)
                            v_j = T.axis.spatial(4096, j_0 * 16 + j_1)
                            T.reads(X[v_i, v_j], rstd[v_i], W[v_j])
                            T.writes(norm[v_i, v_j])
                            T.sblock_attr({"pragma_auto_unroll_max_step": 64, "pragma_unroll_explicit": 1})
                            norm[v_i, v_j] = X[v_i, v_j] * rstd[v_i] * W[v_j]