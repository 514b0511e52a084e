// Append into a quantized cache: quantize the new tokens of every batch entry and write
// their codes and scales in place, one launch (gqakv.quantize's rule, bit for bit).
//
// Entry b, head h, token t < n_new[b]: the d values x = k_new[b, h, t, :] (input type T)
// give scale = max|x| / QMAX and codes round(x / scale) (quantized_kv.cuh), written to
// k_buf[rows[b], h, starts[b] + t, :] and k_scale[rows[b], h, starts[b] + t]; the same for
// V. Grouped codes (CodeLayout<C>::GROUP = G > 0): the same per block of G values, the
// block's scale at k_scale[.., starts[b] + t, block], 4-bit codes as nibbles two a byte.
// Padding slots t >= n_new[b] are never read or written.
// Paged (the KVPages instantiation, paged_kv.cuh): k_buf, v_buf are the code pools
// [num_pages, Hkv, P, d] and k_scale, v_scale the scale pools [num_pages, Hkv, P]; token j
// of row r goes to page table[r, j / P], slot j % P of both (kv_slot, with the codes' and
// the scales' own strides). The pages were taken on the host before the launch.
//
// One warp per token: each lane holds up to ceil(D / 32) values of K and of V (value
// lane + 32 i), the max |x| and NaN / inf flag of each block (the token, or G / 32 of the
// lane's values) reduce over the warp with full-mask xor shuffles (every lane of a warp
// works on the same token, so the loop is uniform per warp), then each lane writes its
// codes (4-bit: the even lane of a pair writes the byte of its value and its neighbour's,
// fetched by a shuffle) and lane 0 the scales.
//
// Launch: grid (B * Hkv, min(65535, ceil(Tn / 4))), block 128; grid-stride over tokens.
// Strides are in elements; the head-dim stride is 1.
#include "common.cuh"
#include "paged_kv.cuh"

template <class T, class C, int D, class... Pages>
__global__ void __launch_bounds__(128) gqakv_write_kv_quantized(
    const T* __restrict__ k_new, const T* __restrict__ v_new,
    C* __restrict__ k_buf, C* __restrict__ v_buf, float* __restrict__ k_scale, float* __restrict__ v_scale,
    const i64* __restrict__ rows, const i64* __restrict__ starts, const i64* __restrict__ n_new,
    int Hkv, int Tn,
    i64 new_sb, i64 new_sh, i64 new_st,
    i64 buf_sb, i64 buf_sh, i64 buf_st,
    i64 sc_sb, i64 sc_sh, i64 sc_st, Pages... pages) {
    constexpr int EPL = (D + 31) / 32;  // values per lane
    constexpr int WARPS = 4;
    constexpr int GROUP = CodeLayout<C>::GROUP, PACK = CodeLayout<C>::PACK;
    static_assert(GROUP == 0 || (GROUP % 32 == 0 && D % GROUP == 0), "grouped codes: whole blocks of 32k values");
    constexpr int NB = GROUP ? D / GROUP : 1;      // scales per token
    constexpr int IPB = GROUP ? GROUP / 32 : EPL;  // a lane's values per block
    const int b = blockIdx.x / Hkv;
    const int h = blockIdx.x % Hkv;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const i64 n = n_new[b];
    const i64 src = (i64)b * new_sb + (i64)h * new_sh;
    const i64 row = rows[b], start = starts[b];
    for (i64 t = (i64)blockIdx.y * WARPS + warp; t < n; t += (i64)gridDim.y * WARPS) {
        // This token's code row and scales (through the page table when paged).
        const i64 dst = kv_slot(row, h, start + t, buf_sb, buf_sh, buf_st, pages...);
        const i64 sdst = kv_slot(row, h, start + t, sc_sb, sc_sh, sc_st, pages...);
        float xk[EPL], xv[EPL];
        float ak[NB], av[NB], bad_k[NB], bad_v[NB];
#pragma unroll
        for (int j = 0; j < NB; ++j) ak[j] = av[j] = bad_k[j] = bad_v[j] = 0.f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int c = lane + 32 * i, j = i / IPB;
            xk[i] = c < D ? to_float(k_new[src + t * new_st + c]) : 0.f;
            xv[i] = c < D ? to_float(v_new[src + t * new_st + c]) : 0.f;
            // !(|x| <= FLT_MAX): NaN or infinite (fmaxf would skip a NaN).
            bad_k[j] = fabsf(xk[i]) <= 3.402823466e38f ? bad_k[j] : 1.f;
            bad_v[j] = fabsf(xv[i]) <= 3.402823466e38f ? bad_v[j] : 1.f;
            ak[j] = fmaxf(ak[j], fabsf(xk[i]));
            av[j] = fmaxf(av[j], fabsf(xv[i]));
        }
        float sk[NB], sv[NB];
#pragma unroll
        for (int j = 0; j < NB; ++j) {
            sk[j] = token_scale<C>(group_max<32>(ak[j]), group_max<32>(bad_k[j]) != 0.f);
            sv[j] = token_scale<C>(group_max<32>(av[j]), group_max<32>(bad_v[j]) != 0.f);
        }
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int c = lane + 32 * i, j = i / IPB;
            if constexpr (PACK == 2) {  // D % 32 == 0: every lane holds a value
                const float yk = scaled_value<C>(xk[i], sk[j]), yv = scaled_value<C>(xv[i], sv[j]);
                const float nk = __shfl_xor_sync(GQAKV_FULL_MASK, yk, 1);  // the pair's other value
                const float nv = __shfl_xor_sync(GQAKV_FULL_MASK, yv, 1);
                if (lane % 2 == 0) {  // value c: low nibble of byte c / 2, c + 1: high
                    k_buf[dst + c / 2].bits = (unsigned char)(encode_nibble(yk) | (encode_nibble(nk) << 4));
                    v_buf[dst + c / 2].bits = (unsigned char)(encode_nibble(yv) | (encode_nibble(nv) << 4));
                }
            } else if (c < D) {
                k_buf[dst + c] = quantize_value<C>(xk[i], sk[j]);
                v_buf[dst + c] = quantize_value<C>(xv[i], sv[j]);
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                k_scale[sdst + j] = sk[j];
                v_scale[sdst + j] = sv[j];
            }
        }
    }
}
