// Lab only (scripts/gemv_lab.py --dp4a): the backend's 8-bit-activation GEMV (`gemv_q8a`,
// `quantize_q8a` in kernels_qx.cu: activations quantized to int8 per 32 values once per
// product, the weights' quants dotted with them by `__dp4a`, as ggml's mmvq kernels) on the
// lab's buffers, with 1, 2 and 4 blocks per loop iteration (the template's U), so that the
// unrolling each type's `_m1` kernel uses is chosen by measurement. Appended to kernels.cu +
// kernels_qx.cu.

extern "C" __global__ void lab_quantize_q8a(const float *x, char *y, i64 K) {
    quantize_q8a(lab_t(x, T_F32, K, 1, 4, K * 4), y);
}

#define LAB_Q8A(NAME, TY, U) \
    extern "C" __global__ void lab_##NAME##_m1_q8u##U(float *d, const char *w, const char *xq, \
                                                       i64 K, i64 N) { \
        Tensor D = lab_t(d, T_F32, N, 1, 4, N * 4), \
               W = lab_t(w, TY, K, N, blk_bytes(TY), K / blk_elems(TY) * blk_bytes(TY)), \
               X = lab_t(0, T_F32, K, 1, 4, K * 4); \
        Ids ids; \
        ids.t = lab_t(0, T_I32, 0, 0, 0, 0); \
        ids.rows = ids.lo = ids.hi = ids.at = 0; \
        gemv_q8a<TY, 1, U>(D, W, X, ids, 0, 0, xq); \
    }
#define LAB_Q8A_ALL(NAME, TY) LAB_Q8A(NAME, TY, 1) LAB_Q8A(NAME, TY, 2) LAB_Q8A(NAME, TY, 4)
LAB_Q8A_ALL(q8_0, T_Q8_0)
LAB_Q8A_ALL(q4_0, T_Q4_0)
LAB_Q8A_ALL(q4_1, T_Q4_1)
LAB_Q8A_ALL(q5_0, T_Q5_0)
LAB_Q8A_ALL(q5_1, T_Q5_1)
LAB_Q8A_ALL(q4_k, T_Q4_K)
LAB_Q8A_ALL(q5_k, T_Q5_K)
LAB_Q8A_ALL(q6_k, T_Q6_K)
