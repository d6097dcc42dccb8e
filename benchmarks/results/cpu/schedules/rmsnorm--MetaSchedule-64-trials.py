# rmsnorm[m=2048,n=4096]:float32;eps=1e-05: MetaSchedule 64 trials
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
        sumsq_rf = T.sblock_alloc_buffer((2048, 64))
        for i_fused in T.parallel(2048, annotations={"pragma_auto_unroll_max_step": 64, "pragma_unroll_explicit": 1}):
            for k_1_fused_init in T.vectorized(64):
                with T.sblock("sumsq_rf_init"):
                    vk_1, v_i = T.axis.remap("SS", [k_1_fused_init, i_fused])
                    T.reads()
                    T.writes(sumsq_rf[v_i, vk_1])
                    sumsq_rf[v_i, vk_1] = T.float32(0.0)
            for k_0 in range(64):
                for k_1_fused in T.vectorized(64):
                    with T.sblock("sumsq_rf_update"):
                        vk_1, v_i, vk_0 = T.axis.remap("SSR", [k_1_fused, i_fused, k_0])
                        T.reads(sumsq_rf[v_i, vk_1], X[v_i, vk_0 * 64 + vk_1])
                        T.writes(sumsq_rf[v_i, vk_1])
                        sumsq_rf[v_i, vk_1] = sumsq_rf[v_i, vk_1] + X[v_i, vk_0 * 64 + vk_1] * X[v_i, vk_0 * 64 + vk_1]
        for i_fused in T.parallel(2048, annotations={"pragma_auto_unroll_max_step": 64, "pragma_unroll_explicit": 1}):
            with T.sblock("sumsq_init"):
                v_i = T.axis.spatial(2048, i_fused)
                T.reads()
                T.writes(sumsq[v_i])
                sumsq[v_i] = T.float32(0.0)
            for k_1 in range(64):
                with T.sblock("sumsq_update"):
                    vk_1, v_i = T.axis.remap("RS", [k_1, i_fused])
                    T.reads(sumsq[v_i], sumsq_rf[v_i, vk_1])
                    T.writes(sumsq[v_i])
                    sumsq[v_i] = sumsq[v_i] + sumsq_rf[v_i, vk_1]
        for i_j_fused_0 in T.parallel(131072):
            for i_j_fused_1 in T.vectorized(64):
                with T.sblock("norm"):
                    v_i = T.axis.spatial(2048, (i_j_fused_0 * 64 + i_j_fused_1) // 4096)
                    v_j = T.axis.spatial(4096, (i_j_fused_0 * 64 + i_j_fused_1) % 4096)
                    T.reads(X[v_i, v_j], sumsq[v_i], W[v_j])
                    T.writes(norm[v_i, v_j])
                    norm[v_i, v_j] = X[v_i, v_j] * T.rsqrt(sumsq[v_i] / T.float32(4096.0) + T.float32(1.0000000000000001e-05)) * W[v_j]