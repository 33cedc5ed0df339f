// Lab only (scripts/gemv_lab.py --dp4a; `lane8i`, `quantize_q8a` and `gemv_q8a` are
// kernels_qx.cu's, the `_prod` kernels run them as the backend does): the one-row quantized GEMV on 8-bit activations and
// integer dot products (`__dp4a`: four int8 products summed into an int32 in one instruction),
// the approach of ggml's mmvq kernels (activations quantized to int8 per 32 values once per
// product, the weights' quants dotted with them as integers, the scales applied once per 4 or 8
// products). Appended to kernels.cu + kernels_qx.cu, so it uses their helpers.
//
// The activations' layout (`q8a`): K int8 quants, then K / 32 f32 scales (K a multiple of 32):
// x[i] ~ d[i / 32] * q[i], d = max |x| / 127 over the 32 values, q = round(x / d).

extern "C" __global__ void lab_quantize_q8a(const float *x, char *y, i64 K) {
    i64 blk = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (blk * 32 >= K) return;
    float v = x[blk * 32 + lane];
    float a = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float d = a / 127.0f;
    int q = d == 0.0f ? 0 : __float2int_rn(v / d);
    y[blk * 32 + lane] = (char)q;
    if (lane == 0) ((float *)(y + K))[blk] = d;
}

// U: blocks per loop iteration (their loads issued before the first is used).
template <int TYPE, int U>
__device__ __forceinline__ void lab_gemv_dp4a(float *d, const char *w, const char *xq, i64 K,
                                          i64 N) {
    constexpr bool MIN = TYPE == T_Q4_K;
    constexpr int BE = blk_elems(TYPE), BB = blk_bytes(TYPE);
    int t, first, step;
    qx_lanes(TYPE, threadIdx.x & 31, &t, &first, &step);
    i64 row = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;
    const char *wr = w + row * (K / BE) * BB;
    const float *xd = (const float *)(xq + K);
    float acc = 0.0f;
    i64 nblk = K / BE;
    for (i64 b0 = first; b0 < nblk; b0 += step * U) {
#pragma unroll
      for (int u = 0; u < U; u++) {
        i64 b = b0 + u * step;
        if (U > 1 && b >= nblk) break;
        int lo, hi, e0, e1;
        float dl, ml;
        lane8i<TYPE>(wr + b * BB, t, &lo, &hi, &dl, &ml, &e0, &e1);
        i64 e = b * BE;
        int xa = *(const int *)(xq + e + e0), xb = *(const int *)(xq + e + e1);
        int s = __dp4a(lo, xa, __dp4a(hi, xb, 0));
        float dx = xd[(e + e0) >> 5];
        if (MIN) {
            int sx = __dp4a(0x01010101, xa, __dp4a(0x01010101, xb, 0));
            acc += dx * (dl * (float)s - ml * (float)sx);
        } else {
            acc += dx * dl * (float)s;
        }
      }
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) d[row] = acc;
}

#define LAB_DP4A(NAME, TY) \
    extern "C" __global__ void lab_##NAME##_m1_dp4a(float *d, const char *w, const char *xq, \
                                                     i64 K, i64 N) { \
        lab_gemv_dp4a<TY, 1>(d, w, xq, K, N); \
    } \
    extern "C" __global__ void lab_##NAME##_m1_dp4a2(float *d, const char *w, const char *xq, \
                                                      i64 K, i64 N) { \
        lab_gemv_dp4a<TY, 2>(d, w, xq, K, N); \
    } \
    extern "C" __global__ void lab_##NAME##_m1_dp4a4(float *d, const char *w, const char *xq, \
                                                      i64 K, i64 N) { \
        lab_gemv_dp4a<TY, 4>(d, w, xq, K, N); \
    }
LAB_DP4A(q4_0, T_Q4_0)
LAB_DP4A(q5_0, T_Q5_0)
LAB_DP4A(q8_0, T_Q8_0)
LAB_DP4A(q4_k, T_Q4_K)
LAB_DP4A(q6_k, T_Q6_K)

// The backend's kernels (kernels_qx.cu) on the lab's buffers.
extern "C" __global__ void lab_prod_quantize(const float *x, char *y, i64 K) {
    quantize_q8a(lab_t(x, T_F32, K, 1, 4, K * 4), y);
}
#define LAB_PROD(NAME, TY, U) \
    extern "C" __global__ void lab_##NAME##_m1_prod(float *d, const char *w, const char *xq, \
                                                     i64 K, i64 N) { \
        Tensor D = lab_t(d, T_F32, N, 1, 4, N * 4), \
               W = lab_t(w, TY, K, N, blk_bytes(TY), K / blk_elems(TY) * blk_bytes(TY)), \
               X = lab_t(0, T_F32, K, 1, 4, K * 4); \
        Ids ids; ids.t = lab_t(0, T_I32, 0, 0, 0, 0); ids.rows = ids.lo = ids.hi = ids.at = 0; \
        gemv_q8a<TY, 1, U>(D, W, X, ids, 0, 0, xq); \
    }
LAB_PROD(q4_0, T_Q4_0, 1)
LAB_PROD(q5_0, T_Q5_0, 1)
LAB_PROD(q8_0, T_Q8_0, 1)
LAB_PROD(q4_k, T_Q4_K, 4)
LAB_PROD(q6_k, T_Q6_K, 2)
