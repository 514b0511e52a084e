// Quantized K/V (gqakv.storage.quantize): codes plus float32 scales; dequantized value =
// code x its scale in float32. Two families share one reader:
//   per token (int8, float8_e4m3fn): one scale per (cache row, KV head, token) for K and V;
//   grouped (int8_g32, int4_g32, int4_g64, int4_g32_rotated): one scale per block of G
//   consecutive values along d, 8-bit codes or 4-bit ones two per byte (value 2i in the
//   low nibble of byte i, stored as code + 8). Rotated keys need nothing here: the host
//   rotates q by the same orthogonal matrix (gqakv.ops.plan).
//
//   gqakv_i8, gqakv_e4m3      the per-token code types (int8; float8_e4m3fn bit patterns);
//   gqakv_i8g<G>, gqakv_i4g<G>   the grouped ones (an int8 code; a byte of two 4-bit codes);
//   CodeLayout<C>             PACK (values per element of C) and GROUP (values per scale;
//                              0: one per token): the only thing the kernels ask of a codec;
//   gqakv_quantized<TQ, C>    the KernelTypes tag of a kernel over a quantized cache: q,
//                              inputs and outputs in TQ, K/V as codes C;
//   QuantizedKV<C, Base>      the K/V reader: rows of codes through a base reader (ContiguousKV
//                              or PagedKV), plus the K and V scale of each (key, value index).
//                              Kernels dequantize as they read: the decode kernel multiplies
//                              a lane's converted codes by their block's scale in registers,
//                              the prefill kernel each key row of its BK-key fp32 tile as it
//                              lands in shared memory. Both give exactly the stored values
//                              (code x scale in fp32), so the arithmetic after is the
//                              unquantized kernels'; no dequantized copy of a row exists;
//   token_scale / quantize_value / encode_e4m3_bits   the append's rule, bit for bit
//                              gqakv.storage.quantize's: the same float32 operations (IEEE
//                              division, no fast math), round half to even, e4m3 rounding
//                              by exact power-of-two scaling.
//
// Scales sit in float32 arrays laid out like the codes with the code row (d / PACK
// elements) replaced by its NS scales (NS = 1 per token, d / G grouped): [rows, Hkv, S(, NS)];
// paged [num_pages, Hkv, P(, NS)]. The scales of the code row at element offset o start at
// o / (d / PACK) * NS (the backend checks the layouts agree, else it takes the generic
// path). Their pointers reach the attention kernels in AttnParams (k_scale, v_scale; null
// for unquantized caches).
#pragma once

struct gqakv_i8 { signed char v; };
struct gqakv_e4m3 { unsigned char bits; };
template <int G> struct gqakv_i8g { signed char v; };
template <int G> struct gqakv_i4g { unsigned char bits; };  // value 2i: low nibble, 2i + 1: high

template <int G> struct CodeLayout<gqakv_i8g<G> > {
    static constexpr int PACK = 1, GROUP = G;
};
template <int G> struct CodeLayout<gqakv_i4g<G> > {
    static constexpr int PACK = 2, GROUP = G;
};

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
template <int G> __device__ __forceinline__ float to_float(gqakv_i8g<G> x) { return (float)x.v; }

// One code of a 32-bit word of four (little-endian bytes), as decode.cu's raw vectors read it.
__device__ __forceinline__ float code_to_float(unsigned byte, gqakv_i8*) { return (float)(signed char)byte; }
__device__ __forceinline__ float code_to_float(unsigned byte, gqakv_e4m3*) { return e4m3_bits_to_float(byte); }
template <int G>
__device__ __forceinline__ float code_to_float(unsigned byte, gqakv_i8g<G>*) { return (float)(signed char)byte; }
// Value e (0..7) of a 32-bit word of eight 4-bit codes: nibble e, little-endian, minus 8.
__device__ __forceinline__ float nibble_to_float(unsigned w, int e) { return (float)((int)((w >> (4 * e)) & 15u) - 8); }

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
// Grouped codes: 8 values per vector (8 bytes of int8, one 32-bit word of nibbles), inside
// one block (G is a multiple of 32, d of G: the table instantiates no other head dim).
template <int G, int D>
struct VecWidth<gqakv_i8g<G>, D> {
    static_assert(G % 32 == 0 && D % G == 0, "grouped codes: whole blocks of a multiple of 32 values");
    static constexpr int value = 8;
};
template <int G, int D>
struct VecWidth<gqakv_i4g<G>, D> {
    static_assert(G % 32 == 0 && D % G == 0, "grouped codes: whole blocks of a multiple of 32 values");
    static constexpr int value = 8;
};

// N values of a row from value v0 as fp32 (v0 a multiple of N): load_vec for one value per
// element; one 32-bit word per 8 values for 4-bit codes.
template <class T, int N>
struct ValueLoad {
    static __device__ __forceinline__ void load(const T* __restrict__ row, int v0, float* out) {
        load_vec<T, N>(row + v0, out);
    }
};
template <int G, int N>
struct ValueLoad<gqakv_i4g<G>, N> {
    static_assert(N % 8 == 0, "4-bit codes load whole 32-bit words");
    static __device__ __forceinline__ void load(const gqakv_i4g<G>* __restrict__ row, int v0, float* out) {
        const unsigned* w = reinterpret_cast<const unsigned*>(row + v0 / 2);
#pragma unroll
        for (int i = 0; i < N / 8; ++i) {
            const unsigned x = w[i];
#pragma unroll
            for (int e = 0; e < 8; ++e) out[8 * i + e] = nibble_to_float(x, e);
        }
    }
};

// The KernelTypes tag of a quantized cache (name expressions spell it
// gqakv_quantized<gqakv_bf16, gqakv_i8>).
template <class TQ, class C>
struct gqakv_quantized {};

// The reader over any base reader Base (ContiguousKV, PagedKV): the codes are read through
// Base<C> exactly as unquantized K/V would be (a row is d / PACK elements of C), and the
// scales through a Base<float> made from the same arguments with every stride divided by
// the code row and times its NS scales. The scales of the code row at element offset o
// start at o / (d / PACK) * NS, and o is a sum of strides x indices, so scaling the
// strides gives the scales' offset without a division per key (the backend checks the
// strides divide). Base's extra arguments (a paged reader's KVPages) are passed to both.
template <class C, template <class> class Base = ContiguousKV>
struct QuantizedKV {
    static constexpr bool SCALED = true;
    static constexpr int GROUP = CodeLayout<C>::GROUP;  // values per scale (0: the token's)
    Base<C> codes;
    Base<float> scales;

    static __device__ __forceinline__ i64 scale_stride(i64 s, int d) {
        return GROUP ? s / (d / CodeLayout<C>::PACK) * (d / GROUP) : s / d;
    }
    template <class P, class... Extra>
    __device__ __forceinline__ QuantizedKV(const C* __restrict__ k_buf, const C* __restrict__ v_buf,
                                           i64 row, int kvh, i64 buf_sb, i64 buf_sh, i64 buf_st,
                                           const P& params, int d, const Extra&... extra)
        : codes(k_buf, v_buf, row, kvh, buf_sb, buf_sh, buf_st, extra...),
          scales(params.k_scale, params.v_scale, row, kvh, scale_stride(buf_sb, d), scale_stride(buf_sh, d),
                 scale_stride(buf_st, d), extra...) {}
    __device__ __forceinline__ const C* k_row(i64 key) const { return codes.k_row(key); }
    __device__ __forceinline__ const C* v_row(i64 key) const { return codes.v_row(key); }
    // The scale of value `value` (an index along d) of key `key`.
    __device__ __forceinline__ float k_scale(i64 key, int value) const {
        return scales.k_row(key)[GROUP ? value / GROUP : 0];
    }
    __device__ __forceinline__ float v_scale(i64 key, int value) const {
        return scales.v_row(key)[GROUP ? value / GROUP : 0];
    }
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
template <int G> struct QuantMax<gqakv_i8g<G> > { static constexpr float value = 127.f; };
template <int G> struct QuantMax<gqakv_i4g<G> > { static constexpr float value = 7.f; };

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

// x / scale clipped to +-QMAX (0 where the scale is 0 or NaN): what a code rounds.
template <class C>
__device__ __forceinline__ float scaled_value(float x, float scale) {
    const float qmax = QuantMax<C>::value;
    const bool ok = scale > 0.f;  // false for 0 and NaN
    const float y = ok ? x / scale : 0.f;
    return fminf(fmaxf(y, -qmax), qmax);
}

// The code of x in a token (or block) of scale `scale`: scaled_value rounded.
template <class C>
__device__ __forceinline__ C quantize_value(float x, float scale) {
    if constexpr (CodeLayout<C>::GROUP != 0) {  // grouped 8-bit (4-bit codes: encode_nibble)
        C c;
        c.v = (signed char)(int)rintf(scaled_value<C>(x, scale));  // round half to even
        return c;
    } else {
        return encode_code<C>(scaled_value<C>(x, scale));
    }
}

// A 4-bit code as its nibble (code + 8, 1..15): rint rounds half to even, |y| <= 7.
__device__ __forceinline__ unsigned encode_nibble(float y) { return (unsigned)((int)rintf(y) + 8); }

// A code holding f itself (scale 1): what a zeroed raw vector of codes holds (decode.cu).
template <> __device__ __forceinline__ gqakv_i8 from_float<gqakv_i8>(float f) {
    return encode_code<gqakv_i8>(fminf(fmaxf(f, -127.f), 127.f));
}
template <> __device__ __forceinline__ gqakv_e4m3 from_float<gqakv_e4m3>(float f) {
    return encode_code<gqakv_e4m3>(fminf(fmaxf(f, -448.f), 448.f));
}
