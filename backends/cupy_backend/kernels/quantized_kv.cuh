// Quantized K/V (gqakv.quantize): 8-bit codes plus one float32 scale per (cache row, KV
// head, token) for K and one for V; dequantized value = code x scale in float32.
//
//   gqakv_i8, gqakv_e4m3      the code types (int8; float8_e4m3fn bit patterns), read as
//                              their exact float value by to_float (the scale comes apart);
//   gqakv_quantized<TQ, C>    the KernelTypes tag of a kernel over a quantized cache: q,
//                              inputs and outputs in TQ, K/V as codes C;
//   QuantizedKV<C, Base>      the K/V reader: rows of codes through a base reader (ContiguousKV
//                              or PagedKV), plus each key's K and V scale. Kernels dequantize as they read: the
//                              decode kernel multiplies a lane's converted codes by the
//                              key's scale in registers, the prefill kernel each key row of
//                              its BK-key fp32 tile as it lands in shared memory. Both give
//                              exactly the stored values (code x scale in fp32), so the
//                              arithmetic after is the unquantized kernels'; no dequantized
//                              copy of a row exists anywhere;
//   quantize_token / encode_e4m3_bits   the append's rule, bit for bit gqakv.quantize's:
//                              the same float32 operations (IEEE division, no fast math),
//                              round half to even, e4m3 rounding by exact power-of-two scaling.
//
// Scales sit in float32 arrays laid out like the codes without the head-dim axis
// ([rows, Hkv, S]; paged [num_pages, Hkv, P]): the scale of the code row at element offset
// o is at o / D (the backend checks the layouts agree, else it takes the generic path). Their pointers reach the
// attention kernels in AttnParams (k_scale, v_scale; null for unquantized caches).
#pragma once

struct gqakv_i8 { signed char v; };
struct gqakv_e4m3 { unsigned char bits; };

// The exact value of an e4m3fn bit pattern (0x7f / 0xff: NaN; no infinities).
__device__ __forceinline__ float e4m3_bits_to_float(unsigned b) {
    const unsigned e = (b >> 3) & 0xfu, m = b & 7u;
    float a;
    if (e == 0u) {
        a = (float)m * 0.001953125f;  // subnormal: m x 2^-9, exact
    } else if (e == 15u && m == 7u) {
        a = __int_as_float(0x7fc00000);
    } else {
        a = __uint_as_float(((e + 120u) << 23) | (m << 20));  // (1 + m / 8) x 2^(e - 7)
    }
    return (b & 0x80u) ? -a : a;
}

__device__ __forceinline__ float to_float(gqakv_i8 x) { return (float)x.v; }
__device__ __forceinline__ float to_float(gqakv_e4m3 x) { return e4m3_bits_to_float(x.bits); }

// One code of a 32-bit word of four (little-endian bytes), as decode.cu's raw vectors read it.
__device__ __forceinline__ float code_to_float(unsigned byte, gqakv_i8*) { return (float)(signed char)byte; }
__device__ __forceinline__ float code_to_float(unsigned byte, gqakv_e4m3*) { return e4m3_bits_to_float(byte); }

// 8-byte vector loads for codes (16-byte ones would give a decode lane 16 elements of
// registers per query, twice a 16-bit cache's); scalar loads when d is not a multiple of 8.
template <int D>
struct VecWidth<gqakv_i8, D> {
    static constexpr int value = D % 8 == 0 ? 8 : 1;
};
template <int D>
struct VecWidth<gqakv_e4m3, D> {
    static constexpr int value = D % 8 == 0 ? 8 : 1;
};

// The KernelTypes tag of a quantized cache (name expressions spell it
// gqakv_quantized<gqakv_bf16, gqakv_i8>).
template <class TQ, class C>
struct gqakv_quantized {};

// The 8-bit reader over any base reader Base (ContiguousKV, PagedKV): the codes are read
// through Base<C> exactly as unquantized K/V would be, and the scales through a Base<float>
// made from the same arguments with every stride divided by d. The scale of the code row at
// element offset o is at o / d (the scales are the codes' layout without the head-dim axis:
// [.., Hkv, S] contiguous, [.., num_pages, Hkv, P] paged), and o is a sum of strides x
// indices, so dividing the strides gives the scale's offset without a division per key.
// Base's extra arguments (a paged reader's KVPages) are passed to both.
template <class C, template <class> class Base = ContiguousKV>
struct QuantizedKV {
    static constexpr bool SCALED = true;
    Base<C> codes;
    Base<float> scales;

    template <class P, class... Extra>
    __device__ __forceinline__ QuantizedKV(const C* __restrict__ k_buf, const C* __restrict__ v_buf,
                                           i64 row, int kvh, i64 buf_sb, i64 buf_sh, i64 buf_st,
                                           const P& params, int d, const Extra&... extra)
        : codes(k_buf, v_buf, row, kvh, buf_sb, buf_sh, buf_st, extra...),
          scales(params.k_scale, params.v_scale, row, kvh, buf_sb / d, buf_sh / d, buf_st / d, extra...) {}
    __device__ __forceinline__ const C* k_row(i64 key) const { return codes.k_row(key); }
    __device__ __forceinline__ const C* v_row(i64 key) const { return codes.v_row(key); }
    __device__ __forceinline__ float k_scale(i64 key) const { return *scales.k_row(key); }
    __device__ __forceinline__ float v_scale(i64 key) const { return *scales.v_row(key); }
};

template <class TQ, class C>
struct KernelTypes<gqakv_quantized<TQ, C> > {
    typedef TQ Q;
    typedef C KV;
    typedef TQ Out;
    // The reader over a base layout reader (kv_reader picks the base: contiguous or paged).
    template <template <class> class Base>
    using ReaderOver = QuantizedKV<C, Base>;
    typedef QuantizedKV<C, ContiguousKV> Reader;
};

// ---- the append's rule (gqakv.quantize) ------------------------------------------------------

template <class C> struct QuantMax;
template <> struct QuantMax<gqakv_i8> { static constexpr float value = 127.f; };
template <> struct QuantMax<gqakv_e4m3> { static constexpr float value = 448.f; };

// The e4m3fn pattern of a finite y with |y| <= 448, round to nearest, ties to even: in
// binade e (2^e <= |y| < 2^(e+1), e clamped to -6..8; subnormals share 2^-9) the quantum
// is 2^(e-3), r = rint(|y| / 2^(e-3)) (an exact power-of-two scaling, then one rounding),
// and the pattern 8 (e + 7) + r - 8 also covers subnormals and a carry into the next binade.
__device__ __forceinline__ unsigned encode_e4m3_bits(float y) {
    const unsigned u = __float_as_uint(y);
    const float a = __uint_as_float(u & 0x7fffffffu);
    int e = (int)((u >> 23) & 0xffu) - 127;  // floor(log2 a) for a normal float
    e = e < -6 ? -6 : (e > 8 ? 8 : e);
    const float r = rintf(a * __uint_as_float((unsigned)(127 + 3 - e) << 23));
    const unsigned bits = (unsigned)(8 * (e + 7)) + (unsigned)r - 8u;
    return bits | ((u >> 24) & 0x80u);
}

template <class C> __device__ __forceinline__ C encode_code(float y);
template <> __device__ __forceinline__ gqakv_i8 encode_code<gqakv_i8>(float y) {
    gqakv_i8 c;
    c.v = (signed char)(int)rintf(y);  // round half to even; |y| <= 127
    return c;
}
template <> __device__ __forceinline__ gqakv_e4m3 encode_code<gqakv_e4m3>(float y) {
    gqakv_e4m3 c;
    c.bits = (unsigned char)encode_e4m3_bits(y);
    return c;
}

// The scale of one token from this lane's elements' max |x| (amax, NaN-free) and whether
// any element of the token is NaN or infinite (bad): both already reduced over the token.
// NaN / inf: NaN (every dequantized value NaN); all zero: 0.
template <class C>
__device__ __forceinline__ float token_scale(float amax, bool bad) {
    return bad ? __int_as_float(0x7fc00000) : amax / QuantMax<C>::value;
}

// The code of x in a token of scale `scale`: x / scale clipped to +-QMAX and rounded;
// 0 where the scale is 0 or NaN.
template <class C>
__device__ __forceinline__ C quantize_value(float x, float scale) {
    const float qmax = QuantMax<C>::value;
    const bool ok = scale > 0.f;  // false for 0 and NaN
    float y = ok ? x / scale : 0.f;
    y = fminf(fmaxf(y, -qmax), qmax);
    return encode_code<C>(y);
}

// A code holding f itself (scale 1): what a zeroed raw vector of codes holds (decode.cu).
template <> __device__ __forceinline__ gqakv_i8 from_float<gqakv_i8>(float f) {
    return encode_code<gqakv_i8>(fminf(fmaxf(f, -127.f), 127.f));
}
template <> __device__ __forceinline__ gqakv_e4m3 from_float<gqakv_e4m3>(float f) {
    return encode_code<gqakv_e4m3>(fminf(fmaxf(f, -448.f), 448.f));
}
