// Append into a quantized cache: quantize the new tokens of every batch entry and write
// their codes and scales in place, one launch (gqakv.quantize's rule, bit for bit).
//
// Entry b, head h, token t < n_new[b]: the d values x = k_new[b, h, t, :] (input type T)
// give scale = max|x| / QMAX and codes round(x / scale) (quantized_kv.cuh), written to
// k_buf[rows[b], h, starts[b] + t, :] and k_scale[rows[b], h, starts[b] + t]; the same for
// V. Padding slots t >= n_new[b] are never read or written.
// Paged (the KVPages instantiation, paged_kv.cuh): k_buf, v_buf are the code pools
// [num_pages, Hkv, P, d] and k_scale, v_scale the scale pools [num_pages, Hkv, P]; token j
// of row r goes to page table[r, j / P], slot j % P of both (kv_slot, with the codes' and
// the scales' own strides). The pages were taken on the host before the launch.
//
// One warp per token: each lane holds up to ceil(D / 32) values of K and of V, the token's
// max |x| and its NaN / inf flag reduce over the warp with full-mask xor shuffles (every
// lane of a warp works on the same token, so the loop is uniform per warp), then each
// lane writes its codes and lane 0 the two scales.
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
    const int b = blockIdx.x / Hkv;
    const int h = blockIdx.x % Hkv;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const i64 n = n_new[b];
    const i64 src = (i64)b * new_sb + (i64)h * new_sh;
    const i64 row = rows[b], start = starts[b];
    for (i64 t = (i64)blockIdx.y * WARPS + warp; t < n; t += (i64)gridDim.y * WARPS) {
        // This token's code row and scale (through the page table when paged).
        const i64 dst = kv_slot(row, h, start + t, buf_sb, buf_sh, buf_st, pages...);
        const i64 sdst = kv_slot(row, h, start + t, sc_sb, sc_sh, sc_st, pages...);
        float xk[EPL], xv[EPL];
        float ak = 0.f, av = 0.f, bad_k = 0.f, bad_v = 0.f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int c = lane + 32 * i;
            xk[i] = c < D ? to_float(k_new[src + t * new_st + c]) : 0.f;
            xv[i] = c < D ? to_float(v_new[src + t * new_st + c]) : 0.f;
            // !(|x| <= FLT_MAX): NaN or infinite (fmaxf would skip a NaN).
            bad_k = fabsf(xk[i]) <= 3.402823466e38f ? bad_k : 1.f;
            bad_v = fabsf(xv[i]) <= 3.402823466e38f ? bad_v : 1.f;
            ak = fmaxf(ak, fabsf(xk[i]));
            av = fmaxf(av, fabsf(xv[i]));
        }
        ak = group_max<32>(ak);
        av = group_max<32>(av);
        bad_k = group_max<32>(bad_k);
        bad_v = group_max<32>(bad_v);
        const float sk = token_scale<C>(ak, bad_k != 0.f);
        const float sv = token_scale<C>(av, bad_v != 0.f);
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int c = lane + 32 * i;
            if (c < D) {
                k_buf[dst + c] = quantize_value<C>(xk[i], sk);
                v_buf[dst + c] = quantize_value<C>(xv[i], sv);
            }
        }
        if (lane == 0) {
            k_scale[sdst] = sk;
            v_scale[sdst] = sv;
        }
    }
}
