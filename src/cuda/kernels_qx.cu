// metashard's CUDA kernels for the weight types after Q4_1: Q5_0, Q5_1 and IQ4_NL (blocks of
// 32), Q2_K .. Q6_K and IQ4_XS (super-blocks of 256), and the GEMV of every quantized type
// (Q8_0, Q4_0 and Q4_1 included: `lane8`, `gemv_qx`). kernels.rs appends this file to
// kernels.cu (one NVRTC source: the types' codes, `Tensor`, h2f / f2h and the GEMV helpers
// `gemv_row` / `gemv_store` are kernels.cu's; `load_q` and `k_quantize` there call `load_qx`
// and `quantize32_qx` here).
//
// Block layouts from ggml-org/ggml `src/ggml-common.h` (`block_q5_0`, `block_q5_1`, `block_q2_K` ..
// `block_q6_K`, `block_iq4_nl`, `block_iq4_xs`, `kvalues_iq4nl`), byte offsets below; the values
// are those of ggml's `dequantize_row_*` (ggml-quants.c) in the operations and order of
// `dtype::formats`, `dtype::kquants` and `dtype::iquants` (x = dl * q - ml per element, dl and ml
// formed first), so a host compiler reproduces the CPU backend's values bit for bit.
//
// Host-testable: everything between HOST-TESTABLE BEGIN and END uses only the T_ codes,
// __device__ / __forceinline__ / __noinline__, u16 / u32 / i64, h2f / f2h, fabsf / sqrtf and the
// intrinsics __fmul_rn / __fadd_rn / __fsub_rn / __float2int_rz / __float_as_int /
// __int_as_float / __byte_perm, so tests/cuda_kernels.rs compiles this text
// with the host C++ compiler (those names defined in plain C++) and checks every value, every
// GEMV lane's elements and every quantized block against the dtype table, with no GPU.
// HOST-TESTABLE BEGIN

// ggml-common.h `kvalues_iq4nl`: the 16 values an IQ4 index selects.
__device__ const signed char KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                             1,    13,   25,  38,  53,  69,  89,  113};

// Whether `type` is one of this file's.
__device__ __forceinline__ bool is_qx(int type) { return type >= T_Q5_0 && type <= T_IQ4_XS; }

// Elements and bytes per block of every quantized type (ggml-common.h's static asserts on the
// structs' sizes), usable as compile-time constants.
__device__ constexpr int blk_elems(int type) {
    return type <= T_Q5_1 || type == T_IQ4_NL ? 32 : 256;
}
__device__ constexpr int blk_bytes(int type) {
    return type == T_Q8_0 ? 34 : type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22
         : type == T_Q5_1 ? 24 : type == T_Q2_K ? 84 : type == T_Q3_K ? 110 : type == T_Q4_K ? 144
         : type == T_Q5_K ? 176 : type == T_Q6_K ? 210 : type == T_IQ4_NL ? 18 : 136;
}

// The same for this file's types, as kernels.cu declares them.
__device__ __forceinline__ int qx_block_elems(int type) { return blk_elems(type); }
__device__ __forceinline__ int qx_block_bytes(int type) { return blk_bytes(type); }

__device__ __forceinline__ int ub(const char *p, int at) { return (unsigned char)p[at]; }

// The f16 at byte `at` (2-byte aligned in every block of this file).
__device__ __forceinline__ float hf(const char *p, int at) { return h2f(*(const u16 *)(p + at)); }

// Element j (0..31) of a block of 32. block_q5_0: d (f16) at 0, qh (4 bytes, a little-endian
// u32: bit j is element j's fifth bit) at 2, qs (16 bytes) at 6; x = (q - 16) d.
// block_q5_1: d at 0, m (f16) at 2, qh at 4, qs at 8; x = q d + m. block_iq4_nl: d at 0, qs at
// 2; x = d kvalues_iq4nl[q]. In qs (Q4_0's order) byte j % 16 holds element j in its low nibble
// for j < 16, in its high nibble for j >= 16.
__device__ __forceinline__ float deq32(const char *blk, int type, int j) {
    float d = hf(blk, 0);
    int qs_at = type == T_Q5_0 ? 6 : type == T_Q5_1 ? 8 : 2;
    int q = (ub(blk, qs_at + (j & 15)) >> (4 * (j >> 4))) & 15;
    if (type == T_IQ4_NL) return d * (float)KV_IQ4NL[q];
    int qh_at = type == T_Q5_0 ? 2 : 4;
    q |= ((ub(blk, qh_at + (j >> 3)) >> (j & 7)) & 1) << 4;
    if (type == T_Q5_0) return (float)(q - 16) * d;
    return (float)q * d + hf(blk, 2);
}

// The scale dl and offset ml of element e (0..255) of a super-block (x = dl q - ml):
//   block_q2_K: scales[16] at 0 (scale of the 16 elements of group g in the low nibble of byte
//     g, its minimum in the high one), qs[64] at 16, d at 80, dmin at 82;
//   block_q3_K: hmask[32] at 0, qs[64] at 32, scales[12] at 96 (16 signed 6-bit scales: the low
//     4 bits of scale g in byte g % 8, nibble g / 8; its top 2 bits in byte 8 + g % 4 at bit
//     2 (g / 4); offset by 32), d at 108;
//   block_q4_K: d at 0, dmin at 2, scales[12] at 4 (eight 6-bit scales and minimums of groups
//     of 32: ggml's get_scale_min_k4), qs[128] at 16;
//   block_q5_K: as Q4_K, then qh[32] at 16 and qs[128] at 48;
//   block_q6_K: ql[128] at 0, qh[64] at 128, scales[16] (int8, one per 16) at 192, d at 208;
//   block_iq4_xs: d at 0, scales_h (u16) at 2, scales_l[4] at 4, qs[128] at 8; the 6-bit
//     scale of group g of 32: low 4 bits in nibble g % 2 of scales_l[g / 2], top 2 bits at
//     bit 2g of scales_h; offset by 32.
__device__ __forceinline__ void kq_scale(const char *blk, int type, int e, float *dl, float *ml) {
    *ml = 0.0f;
    if (type == T_Q2_K) {
        int sc = ub(blk, e >> 4);
        *dl = hf(blk, 80) * (float)(sc & 15);
        *ml = hf(blk, 82) * (float)(sc >> 4);
    } else if (type == T_Q3_K) {
        int g = e >> 4;
        int low = (ub(blk, 96 + (g & 7)) >> (4 * (g >> 3))) & 15;
        int high = (ub(blk, 104 + (g & 3)) >> (2 * (g >> 2))) & 3;
        *dl = hf(blk, 108) * (float)((low | (high << 4)) - 32);
    } else if (type == T_Q4_K || type == T_Q5_K) {
        int g = e >> 5, sc, m;
        if (g < 4) {
            sc = ub(blk, 4 + g) & 63;
            m = ub(blk, 8 + g) & 63;
        } else {
            sc = (ub(blk, 8 + g) & 15) | ((ub(blk, g) >> 6) << 4);
            m = (ub(blk, 8 + g) >> 4) | ((ub(blk, 4 + g) >> 6) << 4);
        }
        *dl = hf(blk, 0) * (float)sc;
        *ml = hf(blk, 2) * (float)m;
    } else if (type == T_Q6_K) {
        *dl = hf(blk, 208) * (float)(signed char)blk[192 + (e >> 4)];
    } else { // T_IQ4_XS
        int g = e >> 5;
        int low = (ub(blk, 4 + (g >> 1)) >> (4 * (g & 1))) & 15;
        int high = (*(const u16 *)(blk + 2) >> (2 * g)) & 3;
        *dl = hf(blk, 0) * (float)((low | (high << 4)) - 32);
    }
}

// The quant of element e (0..255) of a super-block, signed where the type's values are:
//   Q2_K (and Q3_K's low bits): 2 bits of qs[32 (e / 128) + e % 32] at bit 2 ((e % 128) / 32);
//   Q3_K: those minus 4 unless bit e / 32 of hmask[e % 32] is set;
//   Q4_K (and Q5_K's low bits): nibble (e % 64) / 32 of qs[32 (e / 64) + e % 32];
//   Q5_K: plus 16 when bit e / 32 of qh[e % 32] is set;
//   Q6_K: with h = e / 128, r = e % 128: nibble r / 64 of ql[64 h + r % 32 + 32 ((r / 32) % 2)],
//     2 bits of qh[32 h + r % 32] at bit 2 (r / 32) above it, minus 32;
//   IQ4_XS: kvalues_iq4nl of index j = e % 32 of group g = e / 32, nibble j / 16 of
//     qs[16 g + j % 16].
__device__ __forceinline__ int kq_quant(const char *blk, int type, int e) {
    int r = e & 127, lo32 = e & 31;
    switch (type) {
    case T_Q2_K: return (ub(blk, 16 + 32 * (e >> 7) + lo32) >> (2 * (r >> 5))) & 3;
    case T_Q3_K: {
        int q = (ub(blk, 32 + 32 * (e >> 7) + lo32) >> (2 * (r >> 5))) & 3;
        return (ub(blk, lo32) >> (e >> 5)) & 1 ? q : q - 4;
    }
    case T_Q4_K: return (ub(blk, 16 + 32 * (e >> 6) + lo32) >> (4 * ((e & 63) >> 5))) & 15;
    case T_Q5_K: {
        int q = (ub(blk, 48 + 32 * (e >> 6) + lo32) >> (4 * ((e & 63) >> 5))) & 15;
        return q | (((ub(blk, 16 + lo32) >> (e >> 5)) & 1) << 4);
    }
    case T_Q6_K: {
        int h = e >> 7;
        int low = (ub(blk, 64 * h + lo32 + 32 * ((r >> 5) & 1)) >> (4 * (r >> 6))) & 15;
        int high = (ub(blk, 128 + 32 * h + lo32) >> (2 * (r >> 5))) & 3;
        return (low | (high << 4)) - 32;
    }
    default: // T_IQ4_XS
        return KV_IQ4NL[(ub(blk, 8 + 16 * (e >> 5) + (lo32 & 15)) >> (4 * (lo32 >> 4))) & 15];
    }
}

// Element i0 of the row at `row` (packed blocks) of one of this file's types. Not inlined:
// `load` (every element-wise kernel's reader) calls it, and inlined it tripled NVRTC's time
// and swelled every kernel for a path only quantized operands take.
__device__ __noinline__ float load_qx(const char *row, int type, i64 i0) {
    int be = qx_block_elems(type);
    const char *blk = row + (i0 / be) * qx_block_bytes(type);
    int j = (int)(i0 % be);
    if (be == 32) return deq32(blk, type, j);
    float dl, ml;
    kq_scale(blk, type, j, &dl, &ml);
    return dl * (float)kq_quant(blk, type, j) - ml;
}

// The 4 bytes at byte `at` of `p`: 4-byte aligned (`ld32`), or only 2-byte aligned (`ld32h`, two
// 16-bit loads: blocks of 18, 22, 34, 110 and 210 bytes).
__device__ __forceinline__ u32 ld32(const char *p, int at) { return *(const u32 *)(p + at); }
__device__ __forceinline__ u32 ld32h(const char *p, int at) {
    const u16 *h = (const u16 *)(p + at);
    return (u32)h[0] | ((u32)h[1] << 16);
}

// Bit i of the 4-bit `h` to bit 0 of byte i (the four shifted copies do not overlap).
__device__ __forceinline__ u32 spread4(u32 h) { return (h * 0x00204081u) & 0x01010101u; }

// The 4 bytes of `v`, each less `bias`, as floats: byte k placed under the exponent of 2^23
// (0x4B000000 | byte: 2^23 + byte, exactly) less 2^23 + bias, one byte permute and one add per
// value instead of an integer-to-float conversion (a quarter-rate instruction on sm_80/sm_90).
__device__ __forceinline__ void bytes4(u32 v, float bias, float *q) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
        q[k] = __int_as_float((int)__byte_perm(v, 0x4B000000u, 0x7650u + k)) - (8388608.0f + bias);
    }
}

// Lane t of the lanes that share one block in the GEMV (4 lanes per block of 32, 32 per
// super-block of 256), for every quantized type: 8 of its elements as x = dl q[i] - ml, the
// integers q (exact in floats) with the one scale and offset they share, two runs of 4 that
// start at elements *e0 and *e1. The GEMV sums q x over the runs and scales once (dl, ml per
// 8 elements, not per element). A block of 32 gives lane t elements 4t .. 4t + 3 and 16 + 4t ..
// (the low and high nibbles of the same 4 bytes; Q8_0: 8t .. 8t + 7); a super-block gives lane
// t elements 8t .. 8t + 7 (one group of 16 or 32, one scale). The quants of 4 elements come in
// one 32-bit word, unpacked 4 at a time (the bit positions are those of `deq32`/`kq_quant`):
// `lane8_words` gives the two words (each byte a quant before its offset, Q8_0's signed or,
// with Q8_FLIP, plus 128; IQ4's an index), `lane8` their exact floats, `lane8i` their signed
// bytes.
template <int TYPE, u32 Q8_FLIP>
__device__ __forceinline__ void lane8_words(const char *blk, int t, u32 *lo, u32 *hi, float *dl,
                                            float *ml, int *e0, int *e1) {
    u32 l, h;
    *ml = 0.0f;
    if (blk_elems(TYPE) == 32) {
        *dl = hf(blk, 0);
        *e0 = TYPE == T_Q8_0 ? 8 * t : 4 * t;
        *e1 = TYPE == T_Q8_0 ? 8 * t + 4 : 16 + 4 * t;
        if (TYPE == T_Q8_0) {
            // int8 quants at byte 2 (their sign bits flipped by Q8_FLIP = 0x80808080: q + 128).
            l = ld32h(blk, 2 + 8 * t) ^ Q8_FLIP;
            h = ld32h(blk, 6 + 8 * t) ^ Q8_FLIP;
        } else {
            const int qs = TYPE == T_Q4_1 ? 4 : TYPE == T_Q5_0 ? 6 : TYPE == T_Q5_1 ? 8 : 2;
            u32 v = TYPE == T_Q4_1 || TYPE == T_Q5_1 ? ld32(blk, qs + 4 * t) : ld32h(blk, qs + 4 * t);
            l = v & 0x0F0F0F0Fu;
            h = (v >> 4) & 0x0F0F0F0Fu;
            if (TYPE == T_Q5_0 || TYPE == T_Q5_1) {
                u32 qh = TYPE == T_Q5_0 ? ld32h(blk, 2) : ld32(blk, 4);
                l |= spread4((qh >> (4 * t)) & 15) << 4;
                h |= spread4((qh >> (16 + 4 * t)) & 15) << 4;
            }
            if (TYPE == T_Q4_1 || TYPE == T_Q5_1) *ml = -hf(blk, 2);
        }
    } else {
        *e0 = 8 * t;
        *e1 = 8 * t + 4;
        kq_scale(blk, TYPE, 8 * t, dl, ml);
        const int c = t & 3; // the lane's 8 bytes within a run of 32
        if (TYPE == T_Q4_K || TYPE == T_Q5_K) {
            int at = (TYPE == T_Q4_K ? 16 : 48) + 32 * (t >> 3) + 8 * c, sh = 4 * ((t >> 2) & 1);
            l = (ld32(blk, at) >> sh) & 0x0F0F0F0Fu;
            h = (ld32(blk, at + 4) >> sh) & 0x0F0F0F0Fu;
            if (TYPE == T_Q5_K) {
                int hb = t >> 2;
                l |= ((ld32(blk, 16 + 8 * c) >> hb) & 0x01010101u) << 4;
                h |= ((ld32(blk, 20 + 8 * c) >> hb) & 0x01010101u) << 4;
            }
        } else if (TYPE == T_Q6_K) {
            int hh = t >> 4;
            int at = 64 * hh + 8 * c + 32 * ((t >> 2) & 1), sh = 4 * ((t >> 3) & 1);
            int ah = 128 + 32 * hh + 8 * c, sh2 = 2 * ((t >> 2) & 3);
            l = ((ld32h(blk, at) >> sh) & 0x0F0F0F0Fu) | (((ld32h(blk, ah) >> sh2) & 0x03030303u) << 4);
            h = ((ld32h(blk, at + 4) >> sh) & 0x0F0F0F0Fu) |
                (((ld32h(blk, ah + 4) >> sh2) & 0x03030303u) << 4);
        } else if (TYPE == T_Q2_K) {
            int at = 16 + 32 * (t >> 4) + 8 * c, sh = 2 * ((t >> 2) & 3);
            l = (ld32(blk, at) >> sh) & 0x03030303u;
            h = (ld32(blk, at + 4) >> sh) & 0x03030303u;
        } else if (TYPE == T_Q3_K) {
            // q = the 2 low bits + 4 (hmask bit) - 4.
            int at = 32 + 32 * (t >> 4) + 8 * c, sh = 2 * ((t >> 2) & 3), hb = t >> 2;
            l = ((ld32h(blk, at) >> sh) & 0x03030303u) | (((ld32h(blk, 8 * c) >> hb) & 0x01010101u) << 2);
            h = ((ld32h(blk, at + 4) >> sh) & 0x03030303u) |
                (((ld32h(blk, 8 * c + 4) >> hb) & 0x01010101u) << 2);
        } else { // T_IQ4_XS
            int at = 8 + 16 * (t >> 2) + 8 * (c & 1), sh = 4 * (c >> 1);
            l = (ld32(blk, at) >> sh) & 0x0F0F0F0Fu;
            h = (ld32(blk, at + 4) >> sh) & 0x0F0F0F0Fu;
        }
    }
    *lo = l;
    *hi = h;
}

// The offset each quant of `lane8_words` carries (x = dl (q - offset) - ml): Q3_K's 4, Q4_0's
// 8, Q5_0's 16, Q6_K's 32 (Q8_0's bytes are signed already).
__device__ constexpr int q_offset(int type) {
    return type == T_Q3_K ? 4 : type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q6_K ? 32 : 0;
}

template <int TYPE>
__device__ __forceinline__ void lane8(const char *blk, int t, float *q, float *dl, float *ml,
                                      int *e0, int *e1) {
    u32 lo, hi;
    lane8_words<TYPE, 0x80808080u>(blk, t, &lo, &hi, dl, ml, e0, e1);
    if (TYPE == T_IQ4_NL || TYPE == T_IQ4_XS) {
        // Non-linear: the index selects a value of kvalues_iq4nl.
#pragma unroll
        for (int k = 0; k < 4; k++) {
            q[k] = (float)KV_IQ4NL[(lo >> (8 * k)) & 15];
            q[4 + k] = (float)KV_IQ4NL[(hi >> (8 * k)) & 15];
        }
        return;
    }
    const float bias = TYPE == T_Q8_0 ? 128.0f : (float)q_offset(TYPE);
    bytes4(lo, bias, q);
    bytes4(hi, bias, q + 4);
}

// Whether the 8-bit-activation GEMV (`gemv_q8a`) has `type`: the types whose quants `lane8i`
// gives as signed bytes.
__device__ constexpr bool has_q8a(int type) {
    return type == T_Q8_0 || type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 ||
           type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

// `lane8` for the integer dot products of `gemv_q8a`: the same 8 elements of lane t, their
// quants as two words of 4 signed bytes (`lo` at element e0, `hi` at e1; Q4_0, Q5_0 and Q6_K
// less their offsets by a bytewise subtraction, `__vsub4`), with the scale `dl` and offset `ml`
// they share: element = dl q - ml as `lane8` forms it (Q4_1 and Q5_1's minimum m as ml = -m).
template <int TYPE>
__device__ __forceinline__ void lane8i(const char *blk, int t, int *lo, int *hi, float *dl,
                                       float *ml, int *e0, int *e1) {
    u32 l, h;
    lane8_words<TYPE, 0>(blk, t, &l, &h, dl, ml, e0, e1);
    if (q_offset(TYPE) != 0) {
        l = __vsub4(l, 0x01010101u * q_offset(TYPE));
        h = __vsub4(h, 0x01010101u * q_offset(TYPE));
    }
    *lo = (int)l;
    *hi = (int)h;
}

// The GEMV's split of a warp over a row's blocks: lane `lane` is lane *t (0 .. lanes per
// block - 1) of blocks *first, *first + *step, ...
__device__ __forceinline__ void qx_lanes(int type, int lane, int *t, int *first, int *step) {
    int per = qx_block_elems(type) / 8; // 4 or 32
    *t = lane % per;
    *first = lane / per;
    *step = 32 / per;
}

// ggml's best_index_int8 (ggml-quants.c): the index of the kvalues_iq4nl value nearest x, the
// upper one on ties, by bisection.
__device__ __forceinline__ int iq4_best_index(float x) {
    if (x <= (float)KV_IQ4NL[0]) return 0;
    if (x >= (float)KV_IQ4NL[15]) return 15;
    int lo = 0, hi = 15;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (x < (float)KV_IQ4NL[mid]) hi = mid;
        else lo = mid;
    }
    return __fsub_rn(x, (float)KV_IQ4NL[hi - 1]) < __fsub_rn((float)KV_IQ4NL[hi], x) ? hi - 1 : hi;
}

// Super-block quantizers: ggml's reference quantizers (ggml-quants.c quantize_row_q2_K_ref ..
// quantize_row_q6_K_ref, quantize_row_iq4_xs_ref) with their scale searches (make_qx_quants
// with rmse_type 1, make_q3_quants with do_rmse, make_qkx2_quants, quantize_row_iq4_nl_impl),
// in the f32 operations and order of `dtype::kscales`, `dtype::kquants` and `dtype::iquants`
// (each rounded on its own), so the blocks equal the CPU backend's bit for bit. The searches
// are not inlined (NVRTC's time: each is called from several places).

// ggml's nearest_int: x rounded to the nearest integer (ties to even) through the mantissa of
// x + 1.5 * 2^23.
__device__ __forceinline__ int q_nearest(float x) {
    return (__float_as_int(__fadd_rn(x, 12582912.0f)) & 0x007fffff) - 0x00400000;
}

__device__ __forceinline__ int q_clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

// The value of largest magnitude of x[0 .. n) (its sign kept, the first on ties); its magnitude
// in *amax.
__device__ __forceinline__ float q_signed_amax(const float *x, int n, float *amax) {
    float max = 0.0f, a = 0.0f;
    for (int i = 0; i < n; i++) {
        if (fabsf(x[i]) > a) {
            a = fabsf(x[i]);
            max = x[i];
        }
    }
    *amax = a;
    return max;
}

// make_qx_quants(n, nmax, x, L, rmse_type = 1, NULL): quants offset by nmax into l; the scale.
__device__ __noinline__ float q_make_qx(int nmax, const float *x, int n, signed char *l) {
    float amax, max = q_signed_amax(x, n, &amax);
    if (amax < 1e-15f) {
        for (int i = 0; i < n; i++) l[i] = 0;
        return 0.0f;
    }
    float iscale = -(float)nmax / max, scale = 0.0f, best = 0.0f;
    for (int is = -10; is <= 9; is++) {
        if (is == 0) continue;
        float isc = is == -10 ? iscale : -__fadd_rn((float)nmax, __fmul_rn(0.1f, (float)is)) / max;
        float sumlx = 0.0f, suml2 = 0.0f;
        for (int i = 0; i < n; i++) {
            float q = (float)q_clamp(q_nearest(__fmul_rn(isc, x[i])), -nmax, nmax - 1);
            float w = __fmul_rn(x[i], x[i]);
            sumlx = __fadd_rn(sumlx, __fmul_rn(__fmul_rn(w, x[i]), q));
            suml2 = __fadd_rn(suml2, __fmul_rn(__fmul_rn(w, q), q));
        }
        // is = -10 stands for the first pass: its quants are kept whatever they score.
        bool first = is == -10;
        if (first || (suml2 > 0.0f && __fmul_rn(sumlx, sumlx) > __fmul_rn(best, suml2))) {
            for (int i = 0; i < n; i++) {
                l[i] = (signed char)(nmax + q_clamp(q_nearest(__fmul_rn(isc, x[i])), -nmax, nmax - 1));
            }
            scale = first ? (suml2 != 0.0f ? sumlx / suml2 : 0.0f) : sumlx / suml2;
            best = __fmul_rn(scale, sumlx);
        }
    }
    return scale;
}

// make_q3_quants(n, nmax, x, L, do_rmse = true): quants offset by nmax into l (left 0 for a
// group of zeros); the scale.
__device__ __noinline__ float q_make_q3(int nmax, const float *x, int n, signed char *l) {
    float amax, max = q_signed_amax(x, n, &amax);
    if (amax < 1e-15f) {
        for (int i = 0; i < n; i++) l[i] = 0;
        return 0.0f;
    }
    float iscale = -(float)nmax / max, sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < n; i++) {
        int q = q_clamp(q_nearest(__fmul_rn(iscale, x[i])), -nmax, nmax - 1);
        l[i] = (signed char)q;
        float w = __fmul_rn(x[i], x[i]);
        sumlx = __fadd_rn(sumlx, __fmul_rn(__fmul_rn(w, x[i]), (float)q));
        suml2 = __fadd_rn(suml2, __fmul_rn(__fmul_rn(w, (float)q), (float)q));
    }
    for (int itry = 0; itry < 5; itry++) {
        bool changed = false;
        for (int i = 0; i < n; i++) {
            float w = __fmul_rn(x[i], x[i]), old = (float)l[i];
            float slx = __fsub_rn(sumlx, __fmul_rn(__fmul_rn(w, x[i]), old));
            if (slx > 0.0f) {
                float sl2 = __fsub_rn(suml2, __fmul_rn(__fmul_rn(w, old), old));
                int nw = q_clamp(q_nearest(__fmul_rn(x[i], sl2) / slx), -nmax, nmax - 1);
                if (nw != l[i]) {
                    slx = __fadd_rn(slx, __fmul_rn(__fmul_rn(w, x[i]), (float)nw));
                    sl2 = __fadd_rn(sl2, __fmul_rn(__fmul_rn(w, (float)nw), (float)nw));
                    if (sl2 > 0.0f && __fmul_rn(__fmul_rn(slx, slx), suml2) >
                                          __fmul_rn(__fmul_rn(sumlx, sumlx), sl2)) {
                        l[i] = (signed char)nw;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; i++) l[i] = (signed char)(l[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, use_mad):
// x ~ scale * q - the_min with q in 0 .. nmax into l; the scale, the minimum in *the_min.
__device__ __noinline__ float q_make_qkx2(int nmax, float rmin, float rdelta, int nstep, bool mad,
                             const float *x, const float *w, int n, unsigned char *l,
                             float *the_min) {
    float min = x[0], max = x[0], sum_w = w[0], sum_x = __fmul_rn(w[0], x[0]);
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w = __fadd_rn(sum_w, w[i]);
        sum_x = __fadd_rn(sum_x, __fmul_rn(w[i], x[i]));
    }
    if (min > 0.0f) min = 0.0f;
    if (max == min) {
        for (int i = 0; i < n; i++) l[i] = 0;
        *the_min = -min;
        return 0.0f;
    }
    float fmax_ = (float)nmax, scale = 0.0f, best_error = 0.0f;
    unsigned char aux[32];
    for (int is = -1; is <= nstep; is++) {
        // is = -1: the first pass (the range's scale), whose quants and error start the search;
        // later ones search around the best minimum so far, as ggml does.
        float range = __fsub_rn(max, min);
        float iscale = is < 0 ? fmax_ / range
                              : __fadd_rn(__fadd_rn(rmin, __fmul_rn(rdelta, (float)is)), fmax_) / range;
        float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
        for (int i = 0; i < n; i++) {
            int q = q_clamp(q_nearest(__fmul_rn(iscale, __fsub_rn(x[i], min))), 0, nmax);
            aux[i] = (unsigned char)q;
            sum_l = __fadd_rn(sum_l, __fmul_rn(w[i], (float)q));
            sum_l2 = __fadd_rn(sum_l2, __fmul_rn(__fmul_rn(w[i], (float)q), (float)q));
            sum_xl = __fadd_rn(sum_xl, __fmul_rn(__fmul_rn(w[i], (float)q), x[i]));
        }
        float this_scale, this_min = min;
        if (is < 0) {
            this_scale = 1.0f / iscale;
        } else {
            float det = __fsub_rn(__fmul_rn(sum_w, sum_l2), __fmul_rn(sum_l, sum_l));
            if (!(det > 0.0f)) continue;
            this_scale = __fsub_rn(__fmul_rn(sum_w, sum_xl), __fmul_rn(sum_x, sum_l)) / det;
            this_min = __fsub_rn(__fmul_rn(sum_l2, sum_x), __fmul_rn(sum_l, sum_xl)) / det;
            if (this_min > 0.0f) {
                this_min = 0.0f;
                this_scale = sum_xl / sum_l2;
            }
        }
        float err = 0.0f;
        for (int i = 0; i < n; i++) {
            float diff = __fsub_rn(__fadd_rn(__fmul_rn(this_scale, (float)aux[i]), this_min), x[i]);
            err = __fadd_rn(err, __fmul_rn(w[i], mad ? fabsf(diff) : __fmul_rn(diff, diff)));
        }
        if (is < 0 || err < best_error) {
            for (int i = 0; i < n; i++) l[i] = aux[i];
            best_error = err;
            scale = this_scale;
            min = this_min;
        }
    }
    *the_min = -min;
    return scale;
}

// ggml's quantize_row_iq4_nl_impl for one group of 32 without importance weights (weights
// x^2): the scale mapping the largest magnitude to the codebook's end, its least-squares
// refinement, then 2 ntry + 1 starting scales (itry + kvalues[0]) / max, keeping the best. The
// first fit's indices go to l (left untouched, and the scale 0, for a group of zeros).
__device__ float iq4_fit(const float *x, float id, int *l, float *sumq2) {
    float sumqx = 0.0f, s2 = 0.0f;
    for (int j = 0; j < 32; j++) {
        int q = iq4_best_index(__fmul_rn(id, x[j]));
        if (l) l[j] = q;
        float v = (float)KV_IQ4NL[q], w = __fmul_rn(x[j], x[j]);
        sumqx = __fadd_rn(sumqx, __fmul_rn(__fmul_rn(w, v), x[j]));
        s2 = __fadd_rn(s2, __fmul_rn(__fmul_rn(w, v), v));
    }
    *sumq2 = s2;
    return sumqx;
}

__device__ __noinline__ float iq4_group_scale(const float *x, int ntry, int *l) {
    float amax, max = q_signed_amax(x, 32, &amax);
    if (amax < 1e-15f) return 0.0f;
    float k0 = (float)KV_IQ4NL[0];
    float d = ntry > 0 ? -max / k0 : max / k0, sumq2;
    float sumqx = iq4_fit(x, 1.0f / d, l, &sumq2);
    d = sumq2 > 0.0f ? sumqx / sumq2 : 0.0f;
    float best = __fmul_rn(d, sumqx);
    for (int itry = -ntry; itry <= ntry; itry++) {
        float id = (float)(itry + KV_IQ4NL[0]) / max;
        sumqx = iq4_fit(x, id, 0, &sumq2);
        if (sumq2 > 0.0f && __fmul_rn(sumqx, sumqx) > __fmul_rn(best, sumq2)) {
            d = sumqx / sumq2;
            best = __fmul_rn(d, sumqx);
        }
    }
    return d;
}

// The largest of v[0 .. n) and 0 (ggml's `if (s > max) max = s` from 0).
__device__ __forceinline__ float q_max0(const float *v, int n) {
    float m = 0.0f;
    for (int i = 0; i < n; i++) if (v[i] > m) m = v[i];
    return m;
}

// One super-block of 256 values `x` into a Q2_K .. Q6_K or IQ4_XS block at `blk` (every byte
// written). `l` and the scales as `dtype::kquants` / `dtype::iquants` compute them.
__device__ __noinline__ void quantize256_qx(const float *x, int type, char *blk) {
    unsigned char u[256];
    signed char s[256];
    float sc[16], mn[16], w[32];
    for (int i = 0; i < qx_block_bytes(type); i++) blk[i] = 0;
    if (type == T_Q2_K || type == T_Q4_K || type == T_Q5_K) {
        bool q2 = type == T_Q2_K;
        int gs = q2 ? 16 : 32, ng = 256 / gs, nmax = q2 ? 3 : type == T_Q4_K ? 15 : 31;
        for (int g = 0; g < ng; g++) {
            const float *xg = x + gs * g;
            float av = 0.0f;
            if (!q2) {
                float sum_x2 = 0.0f;
                for (int i = 0; i < 32; i++) sum_x2 = __fadd_rn(sum_x2, __fmul_rn(xg[i], xg[i]));
                av = sqrtf(sum_x2 / 32.0f);
            }
            for (int i = 0; i < gs; i++) w[i] = q2 ? fabsf(xg[i]) : __fadd_rn(av, fabsf(xg[i]));
            sc[g] = q2 ? q_make_qkx2(3, -0.5f, 0.1f, 15, true, xg, w, 16, u + 16 * g, &mn[g])
                  : type == T_Q4_K ? q_make_qkx2(15, -1.0f, 0.1f, 20, false, xg, w, 32, u + 32 * g, &mn[g])
                                   : q_make_qkx2(31, -0.5f, 0.1f, 15, false, xg, w, 32, u + 32 * g, &mn[g]);
        }
        float max_scale = q_max0(sc, ng), max_min = q_max0(mn, ng);
        if (q2) {
            // scales[16] at 0 (scale low nibble, minimum high nibble), d at 80, dmin at 82.
            if (max_scale > 0.0f) {
                float is = 15.0f / max_scale;
                for (int g = 0; g < 16; g++) blk[g] = (char)(unsigned char)q_nearest(__fmul_rn(is, sc[g]));
                *(u16 *)(blk + 80) = f2h(max_scale / 15.0f);
            }
            if (max_min > 0.0f) {
                float im = 15.0f / max_min;
                for (int g = 0; g < 16; g++) {
                    blk[g] = (char)(ub(blk, g) | (((unsigned char)q_nearest(__fmul_rn(im, mn[g]))) << 4));
                }
                *(u16 *)(blk + 82) = f2h(max_min / 15.0f);
            }
        } else {
            float is = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
            float im = max_min > 0.0f ? 63.0f / max_min : 0.0f;
            int ls[8], lm[8];
            for (int g = 0; g < 8; g++) {
                ls[g] = (unsigned char)q_nearest(__fmul_rn(is, sc[g]));
                lm[g] = (unsigned char)q_nearest(__fmul_rn(im, mn[g]));
                ls[g] = ls[g] < 63 ? ls[g] : 63;
                lm[g] = lm[g] < 63 ? lm[g] : 63;
            }
            // ggml's inverse of get_scale_min_k4, into scales[12] at 4.
            for (int j = 0; j < 4; j++) {
                blk[4 + j] = (char)(ls[j] | ((ls[j + 4] >> 4) << 6));
                blk[8 + j] = (char)(lm[j] | ((lm[j + 4] >> 4) << 6));
                blk[12 + j] = (char)((ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4));
            }
            *(u16 *)blk = f2h(max_scale / 63.0f);
            *(u16 *)(blk + 2) = f2h(max_min / 63.0f);
        }
        // The quants again from the stored scales (kq_scale reads them back).
        for (int g = 0; g < ng; g++) {
            float dl, ml;
            kq_scale(blk, type, gs * g, &dl, &ml);
            if (dl == 0.0f) continue;
            for (int i = gs * g; i < gs * (g + 1); i++) {
                u[i] = (unsigned char)q_clamp(q_nearest(__fadd_rn(x[i], ml) / dl), 0, nmax);
            }
        }
        int qs_at = q2 ? 16 : type == T_Q4_K ? 16 : 48;
        for (int e = 0; e < 256; e++) {
            if (q2) {
                blk[qs_at + 32 * (e >> 7) + (e & 31)] |= (char)((u[e] & 3) << (2 * ((e & 127) >> 5)));
            } else {
                blk[qs_at + 32 * (e >> 6) + (e & 31)] |= (char)((u[e] & 15) << (4 * ((e & 63) >> 5)));
                if (type == T_Q5_K && u[e] > 15) blk[16 + (e & 31)] |= (char)(1 << (e >> 5));
            }
        }
        return;
    }
    if (type == T_Q3_K) {
        for (int g = 0; g < 16; g++) sc[g] = q_make_q3(4, x + 16 * g, 16, s + 16 * g);
        float amax, max_scale = q_signed_amax(sc, 16, &amax);
        if (max_scale != 0.0f) {
            float iscale = -32.0f / max_scale;
            for (int g = 0; g < 16; g++) {
                int l = q_clamp((signed char)q_nearest(__fmul_rn(iscale, sc[g])), -32, 31) + 32;
                // scales[12] at 96: low 4 bits at byte g % 8, nibble g / 8; top 2 bits at byte
                // 8 + g % 4, bit 2 (g / 4).
                blk[96 + (g & 7)] |= (char)((l & 15) << (4 * (g >> 3)));
                blk[104 + (g & 3)] |= (char)((l >> 4) << (2 * (g >> 2)));
            }
            *(u16 *)(blk + 108) = f2h(1.0f / iscale);
        }
        for (int g = 0; g < 16; g++) {
            float dl, ml;
            kq_scale(blk, type, 16 * g, &dl, &ml);
            if (dl == 0.0f) continue;
            for (int i = 16 * g; i < 16 * (g + 1); i++) {
                s[i] = (signed char)(q_clamp(q_nearest(x[i] / dl), -4, 3) + 4);
            }
        }
        for (int e = 0; e < 256; e++) {
            int q = s[e];
            if (q > 3) blk[e & 31] |= (char)(1 << (e >> 5));
            int low = q > 3 ? q - 4 : q;
            blk[32 + 32 * (e >> 7) + (e & 31)] |= (char)((low & 3) << (2 * ((e & 127) >> 5)));
        }
        return;
    }
    if (type == T_Q6_K) {
        for (int g = 0; g < 16; g++) sc[g] = q_make_qx(32, x + 16 * g, 16, s + 16 * g);
        float amax, max_scale = q_signed_amax(sc, 16, &amax);
        if (amax < 1e-15f) return;
        float iscale = -128.0f / max_scale;
        *(u16 *)(blk + 208) = f2h(1.0f / iscale);
        for (int g = 0; g < 16; g++) {
            int v = q_nearest(__fmul_rn(iscale, sc[g]));
            blk[192 + g] = (char)(signed char)(v < 127 ? v : 127);
        }
        for (int g = 0; g < 16; g++) {
            float dl, ml;
            kq_scale(blk, type, 16 * g, &dl, &ml);
            if (dl == 0.0f) continue;
            for (int i = 16 * g; i < 16 * (g + 1); i++) {
                s[i] = (signed char)(q_clamp(q_nearest(x[i] / dl), -32, 31) + 32);
            }
        }
        for (int e = 0; e < 256; e++) {
            int q = (unsigned char)s[e], h = e >> 7, r = e & 127;
            blk[64 * h + (r & 31) + 32 * ((r >> 5) & 1)] |= (char)((q & 15) << (4 * (r >> 6)));
            blk[128 + 32 * h + (r & 31)] |= (char)(((q >> 4) & 3) << (2 * (r >> 5)));
        }
        return;
    }
    // T_IQ4_XS: d at 0, scales_h at 2, scales_l[4] at 4, qs[128] at 8.
    int l[32];
    for (int g = 0; g < 8; g++) sc[g] = iq4_group_scale(x + 32 * g, 7, l);
    float amax, max_scale = q_signed_amax(sc, 8, &amax);
    float d = -max_scale / 32.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    *(u16 *)blk = f2h(d);
    int sh = 0;
    for (int g = 0; g < 8; g++) {
        int ls = q_clamp(q_nearest(__fmul_rn(id, sc[g])), -32, 31);
        float dl = __fmul_rn(d, (float)ls), idl = dl != 0.0f ? 1.0f / dl : 0.0f;
        for (int j = 0; j < 32; j++) l[j] = iq4_best_index(__fmul_rn(idl, x[32 * g + j]));
        for (int j = 0; j < 16; j++) blk[8 + 16 * g + j] = (char)(l[j] | (l[j + 16] << 4));
        ls += 32;
        blk[4 + (g >> 1)] |= (char)((ls & 15) << (4 * (g & 1)));
        sh |= (ls >> 4) << (2 * g);
    }
    *(u16 *)(blk + 2) = (u16)sh;
}

// One block of 32 values `x` into a Q5_0, Q5_1 or IQ4_NL block at `blk`, with ggml's reference
// quantizers (ggml-quants.c quantize_row_q5_0_ref, _q5_1_ref, and quantize_row_iq4_nl_ref:
// quantize_row_iq4_nl_impl with ntry = -1 and no importance weights), in the f32 operations
// and order of `dtype::formats` and `dtype::iquants` (each rounded on its own), so the blocks
// equal the CPU backend's bit for bit. Indices of an all-zero IQ4_NL block are 0.
__device__ __forceinline__ void quantize32_qx(const float *x, int type, char *blk) {
    int q[32];
    float d = 0.0f;
    if (type == T_Q5_0) {
        float amax, max = q_signed_amax(x, 32, &amax);
        d = max / -16.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) {
            int v = __float2int_rz(__fadd_rn(__fmul_rn(x[j], id), 16.5f));
            q[j] = v < 31 ? v : 31;
        }
    } else if (type == T_IQ4_NL) {
        for (int j = 0; j < 32; j++) q[j] = 0;
        d = iq4_group_scale(x, -1, q);
    } else { // T_Q5_1
        float mn = 3.402823466e38f, mx = -3.402823466e38f;
        for (int j = 0; j < 32; j++) {
            if (x[j] < mn) mn = x[j];
            if (x[j] > mx) mx = x[j];
        }
        d = __fsub_rn(mx, mn) / 31.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) {
            q[j] = __float2int_rz(__fadd_rn(__fmul_rn(__fsub_rn(x[j], mn), id), 0.5f));
        }
        *(u16 *)(blk + 2) = f2h(mn);
    }
    *(u16 *)blk = f2h(d);
    int qs_at = type == T_Q5_0 ? 6 : type == T_Q5_1 ? 8 : 2;
    for (int j = 0; j < 16; j++) blk[qs_at + j] = (char)((q[j] & 15) | ((q[j + 16] & 15) << 4));
    if (type != T_IQ4_NL) {
        int qh_at = type == T_Q5_0 ? 2 : 4;
        for (int b = 0; b < 4; b++) {
            int h = 0;
            for (int i = 0; i < 8; i++) h |= ((q[8 * b + i] >> 4) & 1) << i;
            blk[qh_at + b] = (char)h;
        }
    }
}

// HOST-TESTABLE END

// ---- kernels --------------------------------------------------------------------------------

// sum q[i] x[i] over the 8 values of `lane8` (runs at e0 and e1 of the activation row at `xp`)
// into *s, and with MIN (types with an offset) sum x[i] into *sx; `vec`: the row is packed
// f32, 16-byte aligned (two 16-byte loads).
template <bool MIN>
__device__ __forceinline__ void dot8(const float *q, const char *xp, int e0, int e1, i64 nb0,
                                     bool vec, float *s, float *sx) {
    float a[8];
    if (vec) {
        float4 u = *(const float4 *)(xp + 4 * e0), v = *(const float4 *)(xp + 4 * e1);
        a[0] = u.x; a[1] = u.y; a[2] = u.z; a[3] = u.w;
        a[4] = v.x; a[5] = v.y; a[6] = v.z; a[7] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            a[i] = *(const float *)(xp + (e0 + i) * nb0);
            a[4 + i] = *(const float *)(xp + (e1 + i) * nb0);
        }
    }
    float r = 0.0f, rx = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        r += q[i] * a[i];
        if (MIN) rx += a[i];
    }
    *s = r;
    *sx = rx;
}

// Quantized weights (M <= 8), one kernel per type (`k_mul_mat_vec_<type>`): the type is a
// template constant, so its layout's switches fold away at compile time (one kernel switching
// on the type per element read a Q4_K GEMV at 103 GB/s on an H100, one per type 365 GB/s; the
// Q8_0/Q4_0/Q4_1 kernel that switched per block ran at half the speed of its own per type,
// measured side by side by scripts/gemv_lab.py). `lane8` unpacks 8 quants per lane (a warp
// reads 8 consecutive blocks of 32 or one super-block of 256 per step, and the activations it
// needs are one contiguous run: coalesced 16-byte loads, as ggml's mmvq kernels split a block
// among lanes); each lane sums q x over its 8 values and applies the scale and offset once.
// Each in a variant for one activation row (`_m1`: decoding, `mul_mat_id`), which keeps one
// accumulator instead of eight in registers (ptxas: 48-64 registers against 119-152, so more
// warps per multiprocessor hide the weights' latency).
template <int TYPE, int MMAX>
__device__ __forceinline__ void gemv_qx(const Tensor &dst, const Tensor &w, const Tensor &x,
                                        const Ids &ids, Fault *fault, int node) {
    constexpr bool MIN = TYPE == T_Q4_1 || TYPE == T_Q5_1 || TYPE == T_Q2_K || TYPE == T_Q4_K ||
                         TYPE == T_Q5_K;
    constexpr int BE = blk_elems(TYPE), BB = blk_bytes(TYPE);
    // The lanes' split of the row is `qx_lanes`, which the host test checks element by element.
    int t, first, step;
    qx_lanes(TYPE, threadIdx.x & 31, &t, &first, &step);
    i64 row, b2, b3;
    const char *wr;
    if (!gemv_row(w, x, ids, fault, node, &row, &b2, &b3, &wr)) return;
    i64 K = w.ne[0], M = x.ne[1], nb0 = x.nb[0], nb1 = x.nb[1];
    float acc[MMAX];
    for (int m = 0; m < MMAX; m++) acc[m] = 0.0f;
    i64 nblk = K / BE;
    const char *x0 = x.p + offset(x, 0, 0, b2, b3);
    bool vec = nb0 == 4 && (((u64)x0 | (u64)(M > 1 ? nb1 : 0)) & 15) == 0;
    for (i64 b = first; b < nblk; b += step) {
        float q[8], dl, ml;
        int e0, e1;
        lane8<TYPE>(wr + b * BB, t, q, &dl, &ml, &e0, &e1);
        for (int m = 0; m < MMAX && m < M; m++) {
            float s, sx;
            dot8<MIN>(q, x0 + m * nb1 + b * BE * nb0, e0, e1, nb0, vec, &s, &sx);
            acc[m] += MIN ? dl * s - ml * sx : dl * s;
        }
    }
    gemv_store<MMAX>(dst, acc, M, row, b2, b3);
}

// ---- 8-bit activations (`Precision::Q8`) ----------------------------------------------------
//
// As ggml's mmvq kernels do (ggml-cuda/mmvq.cu, vecdotq.cuh): the activations are quantized to
// int8 once per product, 32 values per scale (`k_quantize_q8a`), and each lane dots its 8
// weight quants with them as integers (`__dp4a`: four int8 products summed into an int32 in
// one instruction), applying the weight's and the activation's scales once per 8 products.
// A quarter of the f32 path's instructions per weight: scripts/gemv_lab.py measured the
// one-row Q4_0 GEMV 1.9x faster, Q4_K 1.5x (on an H100, 2026-11-27).
//
// The quantized activations (`q8a`): row r of x (r = i1 + ne1 (i2 + ne2 i3)) at r * RB bytes,
// RB = K + K / 8: its K int8 quants, then its K / 32 f32 scales; x[i] ~ d q[i], d = max |x| /
// 127 over the 32 values, q = round(x / d) (ggml's quantize_row_q8_0). K is a multiple of 32.
__device__ __forceinline__ i64 q8a_row_bytes(i64 K) { return K + K / 8; }

// One warp per 32 values of x (any strides), `y` the packed rows.
__device__ __forceinline__ void quantize_q8a(const Tensor &x, char *y) {
    i64 K = x.ne[0], nb = K / 32;
    i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (warp >= nb * x.ne[1] * x.ne[2] * x.ne[3]) return;
    i64 r = warp / nb, b = warp % nb;
    i64 i1 = r % x.ne[1], i2 = (r / x.ne[1]) % x.ne[2], i3 = r / (x.ne[1] * x.ne[2]);
    float v = *(const float *)(x.p + offset(x, b * 32 + lane, i1, i2, i3));
    float a = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float d = a / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    char *row = y + r * q8a_row_bytes(K);
    row[b * 32 + lane] = (char)__float2int_rn(v * id);
    if (lane == 0) ((float *)(row + K))[b] = d;
}

extern "C" __global__ void k_quantize_q8a(Tensor x, char *y) { quantize_q8a(x, y); }

// `gemv_qx` on the q8a activations at `xq` (the packed rows of x's view, quantized by
// `k_quantize_q8a`): x's tensor gives the shape only. U blocks per loop iteration (their loads
// issued before the first is used: the lab measured Q4_K 1.3x faster with 4, Q6_K 1.1x with
// 2, the 32-element types slower with any).
template <int TYPE, int MMAX, int U>
__device__ __forceinline__ void gemv_q8a(const Tensor &dst, const Tensor &w, const Tensor &x,
                                         const Ids &ids, Fault *fault, int node,
                                         const char *xq) {
    constexpr bool MIN = TYPE == T_Q4_1 || TYPE == T_Q5_1 || TYPE == T_Q4_K || TYPE == T_Q5_K;
    constexpr int BE = blk_elems(TYPE), BB = blk_bytes(TYPE);
    int t, first, step;
    qx_lanes(TYPE, threadIdx.x & 31, &t, &first, &step);
    i64 row, b2, b3;
    const char *wr;
    if (!gemv_row(w, x, ids, fault, node, &row, &b2, &b3, &wr)) return;
    i64 K = w.ne[0], M = x.ne[1], RB = q8a_row_bytes(K);
    const char *x0 = xq + (b3 * x.ne[2] + b2) * M * RB;
    float acc[MMAX];
    for (int m = 0; m < MMAX; m++) acc[m] = 0.0f;
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
            for (int m = 0; m < MMAX && m < M; m++) {
                const char *xr = x0 + m * RB;
                int xa = *(const int *)(xr + e + e0), xb = *(const int *)(xr + e + e1);
                float dx = ((const float *)(xr + K))[(e + e0) >> 5];
                int s = __dp4a(lo, xa, __dp4a(hi, xb, 0));
                if (MIN) {
                    int sx = __dp4a(0x01010101, xa, __dp4a(0x01010101, xb, 0));
                    acc[m] += dx * (dl * (float)s - ml * (float)sx);
                } else {
                    acc[m] += dx * dl * (float)s;
                }
            }
        }
    }
    gemv_store<MMAX>(dst, acc, M, row, b2, b3);
}

extern "C" __global__ void k_mul_mat_vec_q8a_q8_0(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q8_0, 8, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q8_0_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q8_0, 1, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q4_0(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q4_0, 8, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q4_0_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q4_0, 1, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q4_1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q4_1, 8, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q4_1_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q4_1, 1, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q5_0(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q5_0, 8, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q5_0_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q5_0, 1, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q5_1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q5_1, 8, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q5_1_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q5_1, 1, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q4_k(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q4_K, 8, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q4_k_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q4_K, 1, 4>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q5_k(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q5_K, 8, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q5_k_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q5_K, 1, 4>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q6_k(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q6_K, 8, 1>(dst, w, x, ids, f, node, xq);
}
extern "C" __global__ void k_mul_mat_vec_q8a_q6_k_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                    Fault *f, int node, const char *xq) {
    gemv_q8a<T_Q6_K, 1, 2>(dst, w, x, ids, f, node, xq);
}

extern "C" __global__ void k_mul_mat_vec_q8_0(Tensor dst, Tensor w, Tensor x, Ids ids,
                                              Fault *f, int node) {
    gemv_qx<T_Q8_0, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q8_0_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                 Fault *f, int node) {
    gemv_qx<T_Q8_0, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q4_0(Tensor dst, Tensor w, Tensor x, Ids ids,
                                              Fault *f, int node) {
    gemv_qx<T_Q4_0, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q4_0_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                 Fault *f, int node) {
    gemv_qx<T_Q4_0, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q4_1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                              Fault *f, int node) {
    gemv_qx<T_Q4_1, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q4_1_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                 Fault *f, int node) {
    gemv_qx<T_Q4_1, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q5_0(Tensor dst, Tensor w, Tensor x, Ids ids,
                                              Fault *f, int node) {
    gemv_qx<T_Q5_0, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q5_0_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                 Fault *f, int node) {
    gemv_qx<T_Q5_0, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q5_1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                              Fault *f, int node) {
    gemv_qx<T_Q5_1, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q5_1_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                 Fault *f, int node) {
    gemv_qx<T_Q5_1, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q2_k(Tensor dst, Tensor w, Tensor x, Ids ids,
                                              Fault *f, int node) {
    gemv_qx<T_Q2_K, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q2_k_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                 Fault *f, int node) {
    gemv_qx<T_Q2_K, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q3_k(Tensor dst, Tensor w, Tensor x, Ids ids,
                                              Fault *f, int node) {
    gemv_qx<T_Q3_K, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q3_k_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                 Fault *f, int node) {
    gemv_qx<T_Q3_K, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q4_k(Tensor dst, Tensor w, Tensor x, Ids ids,
                                              Fault *f, int node) {
    gemv_qx<T_Q4_K, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q4_k_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                 Fault *f, int node) {
    gemv_qx<T_Q4_K, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q5_k(Tensor dst, Tensor w, Tensor x, Ids ids,
                                              Fault *f, int node) {
    gemv_qx<T_Q5_K, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q5_k_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                 Fault *f, int node) {
    gemv_qx<T_Q5_K, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q6_k(Tensor dst, Tensor w, Tensor x, Ids ids,
                                              Fault *f, int node) {
    gemv_qx<T_Q6_K, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_q6_k_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                 Fault *f, int node) {
    gemv_qx<T_Q6_K, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_iq4_nl(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                Fault *f, int node) {
    gemv_qx<T_IQ4_NL, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_iq4_nl_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                   Fault *f, int node) {
    gemv_qx<T_IQ4_NL, 1>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_iq4_xs(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                Fault *f, int node) {
    gemv_qx<T_IQ4_XS, 8>(dst, w, x, ids, f, node);
}
extern "C" __global__ void k_mul_mat_vec_iq4_xs_m1(Tensor dst, Tensor w, Tensor x, Ids ids,
                                                   Fault *f, int node) {
    gemv_qx<T_IQ4_XS, 1>(dst, w, x, ids, f, node);
}

// `cont` / `cpy` into a super-block type (Q2_K .. Q6_K, IQ4_XS) from a float source of any
// strides: one thread per destination super-block, element k of `src` (logical order) to
// element k of `dst`, by `quantize256_qx` (bit-identical to the CPU backend's blocks).
extern "C" __global__ void k_quantize_qk(Tensor dst, Tensor src) {
    i64 n = nrows(dst) * (dst.ne[0] >> 8);
    GRID_STRIDE(k, n) {
        float x[256];
        i64 blk;
        char *row = quantize_source(dst, src, k, 256, x, &blk);
        quantize256_qx(x, dst.type, row + blk * qx_block_bytes(dst.type));
    }
}
