// metashard's CUDA kernels, compiled once per process by NVRTC (src/cuda/kernels.rs) for the
// device's compute capability. No headers: NVRTC builds this without the CUDA toolkit's include
// directory, so f16 and bf16 are handled as 16-bit integers with PTX conversions, and math comes
// from NVRTC's built-in device functions.
//
// Every kernel reads and writes tensors through `Tensor` (a device pointer, ggml's `ne`/`nb`:
// elements and byte strides per dimension, and a dtype code), so views, permutations and
// broadcasts need no copies. The semantics are the CPU backend's (src/cpu/ops/), which follow
// ggml's ops of the same names: row-wise ops reduce dimension 0, binary ops broadcast the second
// source by index modulo its extent, `get_rows` / `set_rows` index dimension 1 by I32 ids.
//
// Quantized blocks (ggml's layouts, ggml-org/ggml `src/ggml-common.h`): Q8_0 is an f16 scale and
// 32 int8 (x = d q); Q4_0 an f16 scale and 16 bytes of nibbles, element j in the low nibble of
// byte j and element j + 16 in its high nibble (x = d (q - 8)); Q4_1 an f16 scale, an f16
// minimum and the same nibbles (x = d q + m).

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

#define T_F32 0
#define T_F16 1
#define T_BF16 2
#define T_I32 3
#define T_Q8_0 4
#define T_Q4_0 5
#define T_Q4_1 6
#define T_Q5_0 7
#define T_Q5_1 8
#define T_Q2_K 9
#define T_Q3_K 10
#define T_Q4_K 11
#define T_Q5_K 12
#define T_Q6_K 13
#define T_IQ4_NL 14
#define T_IQ4_XS 15

// Matches `cuda::kernels::Tensor` (repr(C)): 80 bytes.
struct Tensor {
    char *p;
    i64 ne[4];
    i64 nb[4];
    int type;
    int pad;
};

// The expert ids of a GEMV (mul_mat_id; `t.p` null for a plain product) and the experts the
// weights hold (`rows` 0: all of them; else ids lo..hi are the local experts at + id - lo and
// the other ids in 0..rows are computed elsewhere: one device's share of experts split whole).
// Matches `cuda::kernels::Ids`.
struct Ids {
    Tensor t;
    i64 rows, lo, hi, at;
};

// Where a kernel reports a bad operand (an I32 row id outside its table): the first report
// wins; the host reads it after the graph and names the node. Matches `cuda::kernels::Fault`.
struct Fault {
    int flag;
    int node;
    i64 id;
    i64 at[3];
    i64 rows;
};

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf2f(u16 b) { return __int_as_float(((u32)b) << 16); }

// Round to nearest even, NaN kept quiet (as the `half` crate's bf16::from_f32).
__device__ __forceinline__ u16 f2bf(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((x >> 16) | 0x0040u);
    }
    u32 lsb = (x >> 16) & 1u;
    return (u16)((x + 0x7fffu + lsb) >> 16);
}

__device__ __forceinline__ i64 offset(const Tensor &t, i64 i0, i64 i1, i64 i2, i64 i3) {
    return i0 * t.nb[0] + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

__device__ __forceinline__ i64 nelements(const Tensor &t) {
    return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3];
}

__device__ __forceinline__ i64 nrows(const Tensor &t) { return t.ne[1] * t.ne[2] * t.ne[3]; }

// Bytes per element of a float or I32 type; 0 for quantized types.
__device__ __forceinline__ int elem_size(int type) {
    return type == T_F32 || type == T_I32 ? 4 : type == T_F16 || type == T_BF16 ? 2 : 0;
}

// Whether `t` is one packed run of elements of `esize` bytes (element k at byte k * esize).
__device__ __forceinline__ bool packed(const Tensor &t, int esize) {
    return esize != 0 && t.nb[0] == esize && t.nb[1] == t.ne[0] * t.nb[0] &&
           t.nb[2] == t.ne[1] * t.nb[1] && t.nb[3] == t.ne[2] * t.nb[2];
}

// The weight types after Q4_1 (their layouts, dequantization, quantizers and GEMV are in
// kernels_qx.cu, which kernels.rs appends to this source).
__device__ __forceinline__ bool is_qx(int type);
__device__ __forceinline__ int qx_block_bytes(int type);
__device__ __noinline__ float load_qx(const char *row, int type, i64 i0);
__device__ __forceinline__ void quantize32_qx(const float *x, int type, char *blk);

// Element i0 of the row at byte offset `row` of a quantized tensor.
__device__ __forceinline__ float load_q(const char *row, int type, i64 i0) {
    i64 b = i0 >> 5;
    int j = (int)(i0 & 31);
    if (type == T_Q8_0) {
        const char *blk = row + b * 34;
        float d = h2f(*(const u16 *)blk);
        return d * (float)(signed char)blk[2 + j];
    }
    if (type == T_Q4_0) {
        const char *blk = row + b * 18;
        float d = h2f(*(const u16 *)blk);
        unsigned char q = (unsigned char)blk[2 + (j & 15)];
        int v = j < 16 ? (q & 15) : (q >> 4);
        return d * (float)(v - 8);
    }
    if (type == T_Q4_1) {
        const char *blk = row + b * 20;
        float d = h2f(*(const u16 *)blk);
        float m = h2f(*(const u16 *)(blk + 2));
        unsigned char q = (unsigned char)blk[4 + (j & 15)];
        int v = j < 16 ? (q & 15) : (q >> 4);
        return d * (float)v + m;
    }
    if (is_qx(type)) return load_qx(row, type, i0);
    // A code without a layout here (kernels_for and supports_node never let one through): a
    // NaN, never another type's reading of the bytes.
    return __int_as_float(0x7fc00000);
}

// Element (i0, i1, i2, i3) of `t` as f32 (I32 values converted).
__device__ __forceinline__ float load(const Tensor &t, i64 i0, i64 i1, i64 i2, i64 i3) {
    switch (t.type) {
    case T_F32: return *(const float *)(t.p + offset(t, i0, i1, i2, i3));
    case T_F16: return h2f(*(const u16 *)(t.p + offset(t, i0, i1, i2, i3)));
    case T_BF16: return bf2f(*(const u16 *)(t.p + offset(t, i0, i1, i2, i3)));
    case T_I32: return (float)*(const int *)(t.p + offset(t, i0, i1, i2, i3));
    default: return load_q(t.p + offset(t, 0, i1, i2, i3), t.type, i0);
    }
}

__device__ __forceinline__ void store(const Tensor &t, i64 i0, i64 i1, i64 i2, i64 i3, float v) {
    char *a = t.p + offset(t, i0, i1, i2, i3);
    switch (t.type) {
    case T_F32: *(float *)a = v; break;
    case T_F16: *(u16 *)a = f2h(v); break;
    case T_BF16: *(u16 *)a = f2bf(v); break;
    case T_I32: *(int *)a = (int)v; break;
    default: break; // quantized destinations are refused by supports_op
    }
}

// Element k of a packed float or I32 tensor, as f32; and the store.
__device__ __forceinline__ float load_flat(const Tensor &t, i64 k) {
    switch (t.type) {
    case T_F32: return ((const float *)t.p)[k];
    case T_F16: return h2f(((const u16 *)t.p)[k]);
    case T_BF16: return bf2f(((const u16 *)t.p)[k]);
    default: return (float)((const int *)t.p)[k];
    }
}

__device__ __forceinline__ void store_flat(const Tensor &t, i64 k, float v) {
    switch (t.type) {
    case T_F32: ((float *)t.p)[k] = v; break;
    case T_F16: ((u16 *)t.p)[k] = f2h(v); break;
    case T_BF16: ((u16 *)t.p)[k] = f2bf(v); break;
    default: ((int *)t.p)[k] = (int)v; break;
    }
}

__device__ __forceinline__ void unravel(i64 k, const i64 *ne, i64 *i) {
    i[0] = k % ne[0];
    k /= ne[0];
    i[1] = k % ne[1];
    k /= ne[1];
    i[2] = k % ne[2];
    i[3] = k / ne[2];
}

#define GRID_STRIDE(k, n) \
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < (n); k += (i64)gridDim.x * blockDim.x)

// ---- copies -------------------------------------------------------------------------------

// Element `a` of `src` to element `b` of `dst`: equal dtypes of 4 or 2 bytes move bits (no
// rounding through f32, so I32 and NaN payloads survive); others convert through f32.
__device__ __forceinline__ void copy_elem(const Tensor &dst, const i64 *b, const Tensor &src, const i64 *a) {
    char *to = dst.p + offset(dst, b[0], b[1], b[2], b[3]);
    const char *from = src.p + offset(src, a[0], a[1], a[2], a[3]);
    if (src.type == dst.type && (src.type == T_F32 || src.type == T_I32)) {
        *(u32 *)to = *(const u32 *)from;
    } else if (src.type == dst.type && (src.type == T_F16 || src.type == T_BF16)) {
        *(u16 *)to = *(const u16 *)from;
    } else {
        store(dst, b[0], b[1], b[2], b[3], load(src, a[0], a[1], a[2], a[3]));
    }
}

// `cont` / `cpy`: element k of `src` (logical order) to element k of `dst`, converting.
// Packed operands take flat paths: equal types move 16-byte words where the run allows (the
// tail and unaligned runs byte by byte), others convert without index arithmetic.
extern "C" __global__ void k_cpy(Tensor dst, Tensor src) {
    i64 n = nelements(dst);
    int ss = elem_size(src.type), ds = elem_size(dst.type);
    if (packed(src, ss) && packed(dst, ds)) {
        if (src.type == dst.type) {
            i64 bytes = n * ss, words = 0;
            if ((((u64)src.p | (u64)dst.p) & 15) == 0) {
                words = bytes >> 4;
                GRID_STRIDE(k, words) {
                    ((uint4 *)dst.p)[k] = ((const uint4 *)src.p)[k];
                }
            }
            GRID_STRIDE(k, bytes - words * 16) {
                dst.p[words * 16 + k] = src.p[words * 16 + k];
            }
        } else {
            GRID_STRIDE(k, n) {
                store_flat(dst, k, load_flat(src, k));
            }
        }
        return;
    }
    GRID_STRIDE(k, n) {
        i64 a[4], b[4];
        unravel(k, src.ne, a);
        unravel(k, dst.ne, b);
        copy_elem(dst, b, src, a);
    }
}

// Destination block `k` (of `be` elements; blocks counted row by row) of a quantizing copy:
// its source values into `x` (element k of `src` in logical order to element k of `dst`), its
// index in its row into *blk; the address of its row in `dst`.
__device__ __forceinline__ char *quantize_source(const Tensor &dst, const Tensor &src, i64 k,
                                                 int be, float *x, i64 *blk) {
    i64 per_row = dst.ne[0] / be, r = k / per_row;
    *blk = k % per_row;
    i64 one[4] = {1, dst.ne[1], dst.ne[2], dst.ne[3]};
    i64 b[4], a[4];
    unravel(r, one, b);
    for (int j = 0; j < be; j++) {
        unravel(r * dst.ne[0] + *blk * be + j, src.ne, a);
        x[j] = load(src, a[0], a[1], a[2], a[3]);
    }
    return dst.p + offset(dst, 0, b[1], b[2], b[3]);
}

// `cont` / `cpy` into a quantized type from a float source of any strides: one thread per
// destination block of 32, element k of `src` (logical order) to element k of `dst`, with
// ggml's reference quantizers (quantize_row_q8_0_ref, _q4_0_ref, _q4_1_ref in ggml-quants.c;
// Q5_0, Q5_1 and IQ4_NL by `quantize32_qx`; the super-block types by `k_quantize_qk`),
// the same arithmetic as `dtype::formats` (products and sums rounded separately, never fused,
// so the blocks equal the CPU backend's bit for bit).
extern "C" __global__ void k_quantize(Tensor dst, Tensor src) {
    i64 n = nrows(dst) * (dst.ne[0] >> 5);
    GRID_STRIDE(k, n) {
        float x[32];
        i64 blk;
        char *row = quantize_source(dst, src, k, 32, x, &blk);
        if (dst.type == T_Q8_0) {
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            char *blk_p = row + blk * 34;
            *(u16 *)blk_p = f2h(d);
            for (int j = 0; j < 32; j++) {
                float q = roundf(__fmul_rn(x[j], id));
                blk_p[2 + j] = (signed char)fminf(fmaxf(q, -128.0f), 127.0f);
            }
        } else if (dst.type == T_Q4_0) {
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < 32; j++) {
                if (fabsf(x[j]) > amax) {
                    amax = fabsf(x[j]);
                    max = x[j];
                }
            }
            float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            char *blk_p = row + blk * 18;
            *(u16 *)blk_p = f2h(d);
            for (int j = 0; j < 16; j++) {
                int q0 = min(__float2int_rz(__fadd_rn(__fmul_rn(x[j], id), 8.5f)), 15);
                int q1 = min(__float2int_rz(__fadd_rn(__fmul_rn(x[16 + j], id), 8.5f)), 15);
                blk_p[2 + j] = (char)((q0 & 15) | ((q1 & 15) << 4));
            }
        } else if (dst.type == T_Q4_1) {
            float mn = 3.402823466e38f, mx = -3.402823466e38f;
            for (int j = 0; j < 32; j++) {
                mn = fminf(mn, x[j]);
                mx = fmaxf(mx, x[j]);
            }
            float d = (mx - mn) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            char *blk_p = row + blk * 20;
            *(u16 *)blk_p = f2h(d);
            *(u16 *)(blk_p + 2) = f2h(mn);
            for (int j = 0; j < 16; j++) {
                int q0 = min(__float2int_rz(__fadd_rn(__fmul_rn(__fsub_rn(x[j], mn), id), 0.5f)), 15);
                int q1 = min(__float2int_rz(__fadd_rn(__fmul_rn(__fsub_rn(x[16 + j], mn), id), 0.5f)), 15);
                blk_p[4 + j] = (char)((q0 & 15) | ((q1 & 15) << 4));
            }
        } else if (dst.type == T_Q5_0 || dst.type == T_Q5_1 || dst.type == T_IQ4_NL) {
            quantize32_qx(x, dst.type, row + blk * qx_block_bytes(dst.type));
        }
    }
}

// Quantized rows copied as bytes (same dtype, same row length, packed rows).
extern "C" __global__ void k_cpy_rows_bytes(Tensor dst, Tensor src, i64 row_bytes) {
    i64 n = nrows(dst) * row_bytes;
    GRID_STRIDE(k, n) {
        i64 r = k / row_bytes, c = k % row_bytes;
        i64 a[4], b[4];
        i64 one[4] = {1, src.ne[1], src.ne[2], src.ne[3]};
        i64 oned[4] = {1, dst.ne[1], dst.ne[2], dst.ne[3]};
        unravel(r, one, a);
        unravel(r, oned, b);
        dst.p[offset(dst, 0, b[1], b[2], b[3]) + c] = src.p[offset(src, 0, a[1], a[2], a[3]) + c];
    }
}

extern "C" __global__ void k_concat(Tensor dst, Tensor a, Tensor b, int dim) {
    i64 n = nelements(dst);
    GRID_STRIDE(k, n) {
        i64 o[4], i[4];
        unravel(k, dst.ne, o);
        for (int d = 0; d < 4; d++) i[d] = o[d];
        const Tensor *s = &a;
        if (i[dim] >= a.ne[dim]) {
            i[dim] -= a.ne[dim];
            s = &b;
        }
        copy_elem(dst, o, *s, i);
    }
}

// ---- element-wise -------------------------------------------------------------------------

// op: 0 add, 1 sub, 2 mul, 3 div. `b` broadcasts over `a` by index modulo its extents.
extern "C" __global__ void k_binary(Tensor dst, Tensor a, Tensor b, int op) {
    i64 n = nelements(dst);
    GRID_STRIDE(k, n) {
        i64 i[4];
        unravel(k, dst.ne, i);
        float x = load(a, i[0], i[1], i[2], i[3]);
        float y = load(b, i[0] % b.ne[0], i[1] % b.ne[1], i[2] % b.ne[2], i[3] % b.ne[3]);
        float r = op == 0 ? x + y : op == 1 ? x - y : op == 2 ? x * y : x / y;
        store(dst, i[0], i[1], i[2], i[3], r);
    }
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// op: 0 silu, 1 gelu (tanh), 2 gelu (erf), 3 relu, 4 tanh, 5 scale (x p0 + p1), 6 clamp (p0, p1),
// 7 sigmoid.
extern "C" __global__ void k_unary(Tensor dst, Tensor a, int op, float p0, float p1) {
    i64 n = nelements(dst);
    GRID_STRIDE(k, n) {
        i64 i[4];
        unravel(k, dst.ne, i);
        float x = load(a, i[0], i[1], i[2], i[3]);
        float r;
        switch (op) {
        case 0: r = silu(x); break;
        case 1: r = 0.5f * x * (1.0f + tanhf(0.7978845608f * x * (1.0f + 0.044715f * x * x))); break;
        case 2: r = 0.5f * x * (1.0f + erff(x * 0.70710678118f)); break;
        case 3: r = fmaxf(x, 0.0f); break;
        case 4: r = tanhf(x); break;
        case 5: r = x * p0 + p1; break;
        case 7: r = 1.0f / (1.0f + expf(-x)); break;
        default: r = fminf(fmaxf(x, p0), p1); break;
        }
        store(dst, i[0], i[1], i[2], i[3], r);
    }
}

// silu(gate) * up; `fused_off` > 0: one source, up at element offset `fused_off` of each row.
extern "C" __global__ void k_swiglu(Tensor dst, Tensor g, Tensor u, i64 fused_off) {
    i64 n = nelements(dst);
    GRID_STRIDE(k, n) {
        i64 i[4];
        unravel(k, dst.ne, i);
        float x = load(g, i[0], i[1], i[2], i[3]);
        float y = load(u, i[0] + fused_off, i[1], i[2], i[3]);
        store(dst, i[0], i[1], i[2], i[3], silu(x) * y);
    }
}

// ---- row-wise (one block per row; blockDim.x a power of two <= 1024) -----------------------

// Sum of `v` over the block, in double (as the CPU backend's norms accumulate in f64).
__device__ double block_sum(double v, double *sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float *sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] = fmaxf(sh[t], sh[t + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ void row_index(i64 r, const Tensor &t, i64 *i1, i64 *i2, i64 *i3) {
    *i1 = r % t.ne[1];
    *i2 = (r / t.ne[1]) % t.ne[2];
    *i3 = r / (t.ne[1] * t.ne[2]);
}

// mode 0: rms_norm, 1: norm (mean and variance), 2: sum_rows, 3: mean, 4: sum_sqr_rows.
extern "C" __global__ void k_row_reduce(Tensor dst, Tensor a, int mode, float eps) {
    __shared__ double sh[1024];
    i64 r = blockIdx.x;
    i64 i1, i2, i3;
    row_index(r, a, &i1, &i2, &i3);
    i64 n = a.ne[0];
    if (mode == 0) {
        double ss = 0;
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
            double x = load(a, i, i1, i2, i3);
            ss += x * x;
        }
        ss = block_sum(ss, sh);
        float s = (float)(1.0 / sqrt(ss / (double)(n > 0 ? n : 1) + (double)eps));
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
            store(dst, i, i1, i2, i3, load(a, i, i1, i2, i3) * s);
        }
    } else if (mode == 1) {
        double s1 = 0;
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) s1 += load(a, i, i1, i2, i3);
        double mean = block_sum(s1, sh) / (double)(n > 0 ? n : 1);
        double s2 = 0;
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
            double d = load(a, i, i1, i2, i3) - mean;
            s2 += d * d;
        }
        double var = block_sum(s2, sh) / (double)(n > 0 ? n : 1);
        double s = 1.0 / sqrt(var + (double)eps);
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
            store(dst, i, i1, i2, i3, (float)((load(a, i, i1, i2, i3) - mean) * s));
        }
    } else {
        double s1 = 0;
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
            double x = load(a, i, i1, i2, i3);
            s1 += mode == 4 ? x * x : x;
        }
        s1 = block_sum(s1, sh);
        if (threadIdx.x == 0) {
            store(dst, 0, i1, i2, i3, (float)(mode == 3 ? s1 / (double)n : s1));
        }
    }
}

// x * w / sqrt(sums / width + eps) per row: rms_norm's scale from the whole row's sum of
// squares (computed apart: `sums` [1, ne1, ne2, ne3], f32), then the weight `w` [ne0].
extern "C" __global__ void k_rms_norm_sums(Tensor dst, Tensor x, Tensor sums, Tensor w, float eps,
                                           i64 width) {
    i64 r = blockIdx.x;
    i64 i1, i2, i3;
    row_index(r, x, &i1, &i2, &i3);
    double ss = load(sums, 0, i1, i2, i3);
    float s = (float)(1.0 / sqrt(ss / (double)(width > 0 ? width : 1) + (double)eps));
    for (i64 i = threadIdx.x; i < x.ne[0]; i += blockDim.x) {
        store(dst, i, i1, i2, i3, (load(x, i, i1, i2, i3) * s) * load(w, i, 0, 0, 0));
    }
}

// softmax(x * scale + mask) per row; the mask (if `has_mask`) broadcasts over dims 2 and 3. A
// row masked everywhere gives zeros (as the CPU backend), not NaN.
extern "C" __global__ void k_soft_max(Tensor dst, Tensor a, Tensor mask, int has_mask, float scale) {
    __shared__ double sh[1024];
    float *shf = (float *)sh;
    i64 r = blockIdx.x;
    i64 i1, i2, i3;
    row_index(r, a, &i1, &i2, &i3);
    i64 n = a.ne[0];
    float mx = NEG_INF;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        float x = load(a, i, i1, i2, i3) * scale;
        if (has_mask) x += load(mask, i, i1, i2 % mask.ne[2], i3 % mask.ne[3]);
        mx = fmaxf(mx, x);
    }
    mx = block_max(mx, shf);
    if (mx == NEG_INF) {
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) store(dst, i, i1, i2, i3, 0.0f);
        return;
    }
    double sum = 0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        float x = load(a, i, i1, i2, i3) * scale;
        if (has_mask) x += load(mask, i, i1, i2 % mask.ne[2], i3 % mask.ne[3]);
        sum += (double)expf(x - mx);
    }
    sum = block_sum(sum, sh);
    float inv = (float)(1.0 / sum);
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        float x = load(a, i, i1, i2, i3) * scale;
        if (has_mask) x += load(mask, i, i1, i2 % mask.ne[2], i3 % mask.ne[3]);
        store(dst, i, i1, i2, i3, expf(x - mx) * inv);
    }
}

// Index of each row's first maximum, I32 [ne1].
extern "C" __global__ void k_argmax(Tensor dst, Tensor a) {
    __shared__ float sv[1024];
    __shared__ i64 si[1024];
    i64 r = blockIdx.x;
    i64 n = a.ne[0];
    float best = NEG_INF;
    i64 bi = n;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        float x = load(a, i, r, 0, 0);
        if (bi == n || x > best) {
            best = x;
            bi = i;
        }
    }
    int t = threadIdx.x;
    sv[t] = best;
    si[t] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) {
            float o = sv[t + s];
            i64 oi = si[t + s];
            if (oi < n && (si[t] >= n || o > sv[t] || (o == sv[t] && oi < si[t]))) {
                sv[t] = o;
                si[t] = oi;
            }
        }
        __syncthreads();
    }
    if (t == 0) *(int *)(dst.p + r * dst.nb[0]) = (int)(si[0] < n ? si[0] : 0);
}

// f32 bits as an int whose order is Rust's `f32::total_cmp` (negative values' magnitude bits
// flipped), so that NaNs and signed zeros sort as the CPU backend sorts them.
__device__ __forceinline__ int total_key(float v) {
    int b = __float_as_int(v);
    return b ^ (int)(((u32)(b >> 31)) >> 1);
}

// ggml `argsort` (ggml.c `ggml_argsort`): each row's indices in the order that sorts it,
// descending or ascending by value, equal values by index (the CPU backend's order: one
// permutation whatever the algorithm). One block per row, the row's keys in shared memory
// (ne0 * 4 bytes); thread i places index i at its rank, the count of elements ordered before
// it: O(ne0^2 / threads) comparisons, for the short rows argsort sorts (a router's experts;
// supports_node bounds ne0).
extern "C" __global__ void k_argsort(Tensor dst, Tensor a, int descending) {
    extern __shared__ int keys[];
    i64 i1, i2, i3;
    row_index(blockIdx.x, a, &i1, &i2, &i3);
    int n = (int)a.ne[0];
    for (int i = threadIdx.x; i < n; i += blockDim.x) keys[i] = total_key(load(a, i, i1, i2, i3));
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        int ki = keys[i], rank = 0;
        for (int j = 0; j < n; j++) {
            int kj = keys[j];
            rank += (descending ? kj > ki : kj < ki) || (kj == ki && j < i);
        }
        *(int *)(dst.p + offset(dst, rank, i1, i2, i3)) = i;
    }
}

// Rotary embedding, one thread per (pair, row): theta_i = pos freq_scale freq_base^(-2i/n_dims)
// in double; mode 0 rotates (2i, 2i+1), mode 1 (NeoX) (i, i + n_dims/2); dimensions from
// n_dims on are copied; with has_ff, pair i's angle is divided by ff[i] (ggml_rope_ext's frequency
// factors, Llama 3's rope_freqs).
extern "C" __global__ void k_rope(Tensor dst, Tensor x, Tensor pos, int mode, int n_dims,
                                  float freq_base, float freq_scale, Tensor ff, int has_ff) {
    i64 half_ = n_dims / 2;
    i64 rest = x.ne[0] - 2 * half_;
    i64 per_row = half_ + rest;
    i64 n = nrows(x) * per_row;
    GRID_STRIDE(k, n) {
        i64 r = k / per_row, c = k % per_row;
        i64 i1, i2, i3;
        row_index(r, x, &i1, &i2, &i3);
        if (c >= half_) {
            i64 i0 = 2 * half_ + (c - half_);
            store(dst, i0, i1, i2, i3, load(x, i0, i1, i2, i3));
            continue;
        }
        double t = (double)*(const int *)(pos.p + i2 * pos.nb[0]);
        double theta = t * (double)freq_scale * pow((double)freq_base, -2.0 * (double)c / (double)n_dims);
        if (has_ff) theta /= (double)*(const float *)(ff.p + c * ff.nb[0]);
        float cs = (float)cos(theta), sn = (float)sin(theta);
        i64 ia = mode == 0 ? 2 * c : c;
        i64 ib = mode == 0 ? 2 * c + 1 : c + half_;
        float x0 = load(x, ia, i1, i2, i3), x1 = load(x, ib, i1, i2, i3);
        store(dst, ia, i1, i2, i3, x0 * cs - x1 * sn);
        store(dst, ib, i1, i2, i3, x0 * sn + x1 * cs);
    }
}

// ---- rows by id ---------------------------------------------------------------------------

__device__ void fault_row(Fault *f, int node, i64 id, i64 a0, i64 a1, i64 a2, i64 rows) {
    if (atomicCAS(&f->flag, 0, 1) == 0) {
        f->node = node;
        f->id = id;
        f->at[0] = a0;
        f->at[1] = a1;
        f->at[2] = a2;
        f->rows = rows;
    }
}

// dst[:, i, j2, j3] = table[:, ids[i, j2, j3], j2, j3]; with a window (`w_rows` > 0: the whole
// table's rows, ids lo..hi held at local row at + id - lo) other valid ids give zeros. One
// block per output row.
extern "C" __global__ void k_get_rows(Tensor dst, Tensor table, Tensor ids, i64 w_rows, i64 lo,
                                      i64 hi, i64 at, Fault *fault, int node) {
    i64 r = blockIdx.x;
    i64 n = dst.ne[1], e2 = dst.ne[2];
    i64 i = r % n, j2 = (r / n) % e2, j3 = r / (n * e2);
    i64 id = *(const int *)(ids.p + offset(ids, i, j2, j3, 0));
    i64 rows = w_rows > 0 ? w_rows : table.ne[1];
    if (id < 0 || id >= rows) {
        if (threadIdx.x == 0) fault_row(fault, node, id, i, j2, j3, rows);
        return;
    }
    i64 local = -1;
    if (w_rows > 0) {
        if (id >= lo && id < hi) local = at + (id - lo);
    } else {
        local = id;
    }
    for (i64 i0 = threadIdx.x; i0 < dst.ne[0]; i0 += blockDim.x) {
        if (dst.type == T_I32) {
            int v = local >= 0 ? *(const int *)(table.p + offset(table, i0, local, j2, j3)) : 0;
            *(int *)(dst.p + offset(dst, i0, i, j2, j3)) = v;
        } else {
            store(dst, i0, i, j2, j3, local >= 0 ? load(table, i0, local, j2, j3) : 0.0f);
        }
    }
}

// dst[:, ids[i, j2 % e2, j3 % e3], j2, j3] = rows[:, i, j2, j3]; with a window, ids it does not
// hold are skipped. One block per source row.
extern "C" __global__ void k_set_rows(Tensor dst, Tensor rows_, Tensor ids, i64 w_rows, i64 lo,
                                      i64 hi, i64 at, Fault *fault, int node) {
    i64 r = blockIdx.x;
    i64 n = rows_.ne[1], d2 = rows_.ne[2];
    i64 i = r % n, j2 = (r / n) % d2, j3 = r / (n * d2);
    i64 a1 = j2 % ids.ne[1], a2 = j3 % ids.ne[2];
    i64 id = *(const int *)(ids.p + offset(ids, i, a1, a2, 0));
    i64 total = w_rows > 0 ? w_rows : dst.ne[1];
    if (id < 0 || id >= total) {
        if (threadIdx.x == 0) fault_row(fault, node, id, i, a1, a2, total);
        return;
    }
    i64 local = id;
    if (w_rows > 0) {
        if (id < lo || id >= hi) return;
        local = at + (id - lo);
    }
    for (i64 i0 = threadIdx.x; i0 < rows_.ne[0]; i0 += blockDim.x) {
        store(dst, i0, local, j2, j3, load(rows_, i0, i, j2, j3));
    }
}

// ---- matrix products ----------------------------------------------------------------------

// GEMV-like products (M <= 8 columns of activations): dst[n, m, b2, b3] = dot(w row n, x row m)
// with f32 activations, the weights dequantized in registers. One warp per weight row and up to
// 8 activation rows; weights broadcast over dims 2, 3 of x (ggml's rule: w.ne2 divides x.ne2).
// Sums in f32 per lane, then a warp reduction. Two kernels, so that the quantized one's
// registers do not lower the float one's occupancy.

// The warp's row, its batch coordinates and the weight row's address; false past the last row
// (or past the last batch: the host spreads the b2 * b3 batches over grid.y and grid.z, whose
// extents are limited to 65535 each). With `ids` (mul_mat_id: ggml.c `ggml_mul_mat_id`), x and
// dst are viewed by the host as [K, 1, n_used, n_tokens] and [N, 1, n_used, n_tokens], and
// batch (e, t) multiplies expert ids[e, t] of the weights [K, N, n_expert, 1]; an id outside the
// experts is reported through the fault record (the warp computes nothing). With a window, an
// id outside it computes nothing either (the host zeroed dst) and the others address the local
// experts.
__device__ __forceinline__ bool gemv_row(const Tensor &w, const Tensor &x, const Ids &ids,
                                         Fault *fault, int node, i64 *row, i64 *b2, i64 *b3,
                                         const char **wr) {
    *row = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (*row >= w.ne[1]) return false;
    i64 yz = (i64)blockIdx.y + (i64)blockIdx.z * gridDim.y;
    *b2 = yz % x.ne[2];
    *b3 = yz / x.ne[2];
    if (*b3 >= x.ne[3]) return false;
    i64 w2, w3;
    if (ids.t.p) {
        i64 id = *(const int *)(ids.t.p + offset(ids.t, *b2, *b3, 0, 0));
        i64 rows = ids.rows ? ids.rows : w.ne[2];
        if (id < 0 || id >= rows) {
            if ((threadIdx.x & 31) == 0) fault_row(fault, node, id, *b2, *b3, 0, rows);
            return false;
        }
        if (ids.rows) {
            if (id < ids.lo || id >= ids.hi) return false;
            id = ids.at + id - ids.lo;
        }
        w2 = id;
        w3 = 0;
    } else {
        w2 = *b2 / (x.ne[2] / w.ne[2]);
        w3 = *b3 / (x.ne[3] / w.ne[3]);
    }
    *wr = w.p + offset(w, 0, *row, w2, w3);
    return true;
}

// The warp's sums of acc[m] to dst (MMAX: the most activation rows the kernel was built for).
template <int MMAX = 8>
__device__ __forceinline__ void gemv_store(const Tensor &dst, float *acc, i64 M, i64 row, i64 b2,
                                           i64 b3) {
    int lane = threadIdx.x & 31;
    for (int m = 0; m < MMAX && m < M; m++) {
        float v = acc[m];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) *(float *)(dst.p + offset(dst, row, m, b2, b3)) = v;
    }
}

// `q` += the 8 values of `w` (f32, f16 or bf16) at `p` (16-byte aligned).
__device__ __forceinline__ void load8(const char *p, int type, float *q) {
    if (type == T_F32) {
        float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
        q[0] = a.x; q[1] = a.y; q[2] = a.z; q[3] = a.w;
        q[4] = b.x; q[5] = b.y; q[6] = b.z; q[7] = b.w;
        return;
    }
    uint4 v = *(const uint4 *)p;
    u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        u16 lo = (u16)(u[j] & 0xffff), hi = (u16)(u[j] >> 16);
        q[2 * j] = type == T_F16 ? h2f(lo) : bf2f(lo);
        q[2 * j + 1] = type == T_F16 ? h2f(hi) : bf2f(hi);
    }
}

// `n` consecutive values of q dotted with x row `xp` (16-byte loads where packed and aligned).
__device__ __forceinline__ float dot_x(const float *q, int n, const char *xp, i64 nb0) {
    float s = 0.0f;
    if (nb0 == 4 && ((u64)xp & 15) == 0) {
        const float4 *x4 = (const float4 *)xp;
        for (int j = 0; j < n / 4; j++) {
            float4 v = x4[j];
            s += q[4 * j] * v.x + q[4 * j + 1] * v.y + q[4 * j + 2] * v.z + q[4 * j + 3] * v.w;
        }
    } else {
        for (int j = 0; j < n; j++) s += q[j] * *(const float *)(xp + j * nb0);
    }
    return s;
}

// F32, F16 and BF16 weights: lane l takes chunks of 8 elements l, l + 32, ... (16 or 32 bytes,
// one or two vector loads) where the row is packed and 16-byte aligned, else single elements.
extern "C" __global__ void k_mul_mat_vec(Tensor dst, Tensor w, Tensor x, Ids ids, Fault *fault,
                                         int node) {
    int lane = threadIdx.x & 31;
    i64 row, b2, b3;
    const char *wr;
    if (!gemv_row(w, x, ids, fault, node, &row, &b2, &b3, &wr)) return;
    i64 K = w.ne[0], M = x.ne[1];
    float acc[8];
    for (int m = 0; m < 8; m++) acc[m] = 0.0f;
    int es = w.type == T_F32 ? 4 : 2;
    i64 chunks = (w.nb[0] == es && ((u64)wr & 15) == 0) ? K / 8 : 0;
    for (i64 c = lane; c < chunks; c += 32) {
        float q[8];
        load8(wr + c * 8 * es, w.type, q);
        for (int m = 0; m < 8 && m < M; m++) {
            acc[m] += dot_x(q, 8, x.p + offset(x, c * 8, m, b2, b3), x.nb[0]);
        }
    }
    for (i64 k = chunks * 8 + lane; k < K; k += 32) {
        float wv = w.type == T_F32 ? *(const float *)(wr + k * w.nb[0])
                 : w.type == T_F16 ? h2f(*(const u16 *)(wr + k * w.nb[0]))
                                   : bf2f(*(const u16 *)(wr + k * w.nb[0]));
        for (int m = 0; m < 8 && m < M; m++) {
            acc[m] += wv * *(const float *)(x.p + offset(x, k, m, b2, b3));
        }
    }
    gemv_store(dst, acc, M, row, b2, b3);
}

// ---- mul_mat_id grouped by expert (prompts) ------------------------------------------------
//
// A prompt's (slot, token) pairs routed to one expert are multiplied together, 8 at a time, so
// each expert's weights are read once per 8 pairs instead of once per pair (the per-pair GEMV
// reads an expert once per token that chose it). As ggml's CUDA backend groups mul_mat_id rows
// by expert before its products (ggml-cuda.cu, ggml_cuda_mul_mat_id), but on the device, with
// no copy of the ids to the host: `k_moe_group` sorts the pairs by expert, `k_moe_gather` packs
// each chunk's activation rows, the GEMV kernels run once over the chunks (ids: each chunk's
// expert), and `k_moe_scatter` puts each product back at its pair. Each pair's output is the
// same dot product in the same order as the per-pair path's, so the bits do not change.

#define MOE_MAX_EXPERTS 4096
#define MOE_CHUNK 8

// The ids [n_used, n_tokens] (I32, any strides) counted by expert (pair p = e + n_used t), in
// one block. Ids outside 0..R are reported through the fault record (as the GEMV does); pairs
// whose expert is outside lo..hi (experts held elsewhere) are left out. Writes `order` (pair
// indices, grouped by expert in increasing expert order) and `max_chunks` chunks of at most 8
// pairs of one expert: chunk_id (R for an unused chunk, which the GEMV skips: outside lo..hi),
// chunk_start (into order), chunk_len. R <= MOE_MAX_EXPERTS (the host checks).
extern "C" __global__ void k_moe_group(Tensor ids, i64 R, i64 lo, i64 hi, int *order,
                                       int *chunk_id, int *chunk_start, int *chunk_len,
                                       i64 max_chunks, Fault *fault, int node) {
    __shared__ int count[MOE_MAX_EXPERTS];
    __shared__ int next[MOE_MAX_EXPERTS];
    i64 n_used = ids.ne[0], pairs = ids.ne[0] * ids.ne[1];
    for (i64 e = threadIdx.x; e < R; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (i64 p = threadIdx.x; p < pairs; p += blockDim.x) {
        i64 e = p % n_used, t = p / n_used;
        i64 id = *(const int *)(ids.p + offset(ids, e, t, 0, 0));
        if (id < 0 || id >= R) {
            fault_row(fault, node, id, e, t, 0, R);
            continue;
        }
        if (id >= lo && id < hi) atomicAdd(&count[id], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0;
        i64 c = 0;
        for (i64 e = lo; e < hi; e++) {
            next[e] = at;
            for (int s = 0; s < count[e] && c < max_chunks; s += MOE_CHUNK, c++) {
                chunk_id[c] = (int)e;
                chunk_start[c] = at + s;
                chunk_len[c] = min(MOE_CHUNK, count[e] - s);
            }
            at += count[e];
        }
        for (; c < max_chunks; c++) {
            chunk_id[c] = (int)R;
            chunk_start[c] = 0;
            chunk_len[c] = 0;
        }
    }
    __syncthreads();
    for (i64 p = threadIdx.x; p < pairs; p += blockDim.x) {
        i64 e = p % n_used, t = p / n_used;
        i64 id = *(const int *)(ids.p + offset(ids, e, t, 0, 0));
        if (id >= lo && id < hi && id < R) order[atomicAdd(&next[id], 1)] = (int)p;
    }
}

// xs [K, 8, chunks] (packed f32) = the activation rows of each chunk's pairs, zeros past its
// length; x is the activations viewed [K, 1, n_used, n_tokens] (f32, any strides).
extern "C" __global__ void k_moe_gather(Tensor xs, Tensor x, const int *order,
                                        const int *chunk_start, const int *chunk_len) {
    i64 K = xs.ne[0], n_used = x.ne[2];
    GRID_STRIDE(i, nelements(xs)) {
        i64 k = i % K, m = (i / K) % MOE_CHUNK, c = i / (K * MOE_CHUNK);
        float v = 0.0f;
        if (m < chunk_len[c]) {
            i64 p = order[chunk_start[c] + m];
            v = *(const float *)(x.p + offset(x, k, 0, p % n_used, p / n_used));
        }
        ((float *)xs.p)[i] = v;
    }
}

// The products ds [N, 8, chunks] (packed f32) back at their pairs of dst, viewed [N, 1, n_used,
// n_tokens].
extern "C" __global__ void k_moe_scatter(Tensor dst, Tensor ds, const int *order,
                                         const int *chunk_start, const int *chunk_len) {
    i64 N = ds.ne[0], n_used = dst.ne[2];
    GRID_STRIDE(i, nelements(ds)) {
        i64 n = i % N, m = (i / N) % MOE_CHUNK, c = i / (N * MOE_CHUNK);
        if (m < chunk_len[c]) {
            i64 p = order[chunk_start[c] + m];
            *(float *)(dst.p + offset(dst, n, 0, p % n_used, p / n_used)) = ((const float *)ds.p)[i];
        }
    }
}

// Any tensor to a packed f32, f16 or bf16 matrix [ne0, ne1 * ne2 * ne3] for cuBLAS (out_type:
// T_F32, T_F16 or T_BF16), in ggml order.
extern "C" __global__ void k_to_dense(char *out, int out_type, Tensor w) {
    i64 n = nelements(w);
    bool flat = packed(w, elem_size(w.type));
    GRID_STRIDE(k, n) {
        float v;
        if (flat) {
            v = load_flat(w, k);
        } else {
            i64 i[4];
            unravel(k, w.ne, i);
            v = load(w, i[0], i[1], i[2], i[3]);
        }
        if (out_type == T_F16) ((u16 *)out)[k] = f2h(v);
        else if (out_type == T_BF16) ((u16 *)out)[k] = f2bf(v);
        else ((float *)out)[k] = v;
    }
}

// ---- attention ----------------------------------------------------------------------------

// softmax(q k^T scale + mask) v per (query row, head, batch), grouped-query heads (head h reads
// kv head h / (H / Hkv)). q [D, n_q, H, B], k [D, n_kv, Hkv, B], v [Dv, n_kv, Hkv, B], mask
// [n_kv, >= n_q] or none; out [Dv, H, n_q, B]. One block per (query row, head, batch), online
// softmax over tiles of blockDim.x kv rows: each thread scores one row of the tile, then every
// thread accumulates its share of the Dv outputs. Dv <= 4 * blockDim.x.
extern "C" __global__ void k_flash_attn(Tensor dst, Tensor q, Tensor k, Tensor v, Tensor mask,
                                        int has_mask, float scale) {
    extern __shared__ float smem[];
    i64 D = q.ne[0], Dv = v.ne[0], n_kv = k.ne[1];
    i64 iq = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    i64 H = q.ne[2], Hk = k.ne[2];
    i64 hk = h / ((H / Hk) > 0 ? (H / Hk) : 1);
    float *qs = smem;              // D
    float *sc = qs + D;            // blockDim.x scores
    float *red = sc + blockDim.x;  // blockDim.x for reductions
    int t = threadIdx.x;
    for (i64 i = t; i < D; i += blockDim.x) qs[i] = load(q, i, iq, h, b);
    float acc[4] = {0, 0, 0, 0};
    float m = NEG_INF, l = 0.0f;
    __syncthreads();
    for (i64 j0 = 0; j0 < n_kv; j0 += blockDim.x) {
        i64 j = j0 + t;
        float s = NEG_INF;
        if (j < n_kv) {
            float mv = has_mask ? load(mask, j, iq, 0, 0) : 0.0f;
            if (mv != NEG_INF) {
                float d = 0.0f;
                for (i64 i = 0; i < D; i++) d += qs[i] * load(k, i, j, hk, b);
                s = d * scale + mv;
            }
        }
        sc[t] = s;
        // Tile maximum.
        red[t] = s;
        __syncthreads();
        for (int st = blockDim.x / 2; st > 0; st >>= 1) {
            if (t < st) red[t] = fmaxf(red[t], red[t + st]);
            __syncthreads();
        }
        float tm = red[0];
        __syncthreads();
        if (tm == NEG_INF) continue;
        float mn = fmaxf(m, tm);
        float corr = m == NEG_INF ? 0.0f : expf(m - mn);
        float p = sc[t] == NEG_INF ? 0.0f : expf(sc[t] - mn);
        sc[t] = p;
        red[t] = p;
        __syncthreads();
        for (int st = blockDim.x / 2; st > 0; st >>= 1) {
            if (t < st) red[t] += red[t + st];
            __syncthreads();
        }
        l = l * corr + red[0];
        m = mn;
        i64 jn = n_kv - j0 < (i64)blockDim.x ? n_kv - j0 : (i64)blockDim.x;
        for (int c = 0; c < 4; c++) {
            i64 o = t + (i64)c * blockDim.x;
            if (o >= Dv) break;
            float a = acc[c] * corr;
            for (i64 jj = 0; jj < jn; jj++) {
                float pj = sc[jj];
                if (pj != 0.0f) a += pj * load(v, o, j0 + jj, hk, b);
            }
            acc[c] = a;
        }
        __syncthreads();
    }
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int c = 0; c < 4; c++) {
        i64 o = t + (i64)c * blockDim.x;
        if (o >= Dv) break;
        store(dst, o, h, iq, b, acc[c] * inv);
    }
}

// ---- collectives between logical devices on one GPU ----------------------------------------

// dst[i] = src_0[i] + src_1[i] + ... + src_{n-1}[i], in rank order in f32 (f16 and bf16 widened
// exactly and rounded once), as the CPU communicator sums (src/collectives/reduce.rs), so the
// results are bit-identical. `srcs` is a device array of `nsrc` pointers; `dst` may equal one.
extern "C" __global__ void k_sum_ranks(char *dst, const char *const *srcs, int nsrc, i64 n, int type) {
    GRID_STRIDE(k, n) {
        float s = 0.0f;
        for (int r = 0; r < nsrc; r++) {
            const char *p = srcs[r];
            float x = type == T_F32 ? ((const float *)p)[k]
                    : type == T_F16 ? h2f(((const u16 *)p)[k])
                                    : bf2f(((const u16 *)p)[k]);
            s = r == 0 ? x : s + x;
        }
        if (type == T_F32) ((float *)dst)[k] = s;
        else if (type == T_F16) ((u16 *)dst)[k] = f2h(s);
        else ((u16 *)dst)[k] = f2bf(s);
    }
}
