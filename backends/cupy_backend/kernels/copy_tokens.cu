// Row copies (reorder, fork): every copy of one Backend.copy_tokens call, all layers, one launch.
//
// Copy i moves the first n_tokens[i] tokens of source row src_rows[i] into destination row
// dst_rows[i], for every layer and KV head, K and V:
//   dst_k[l, dst_rows[i], h, t, :] = src_k[l, src_rows[i], h, t, :]   (t < n_tokens[i])
// Nothing at or past n_tokens[i] is read or written. The copies of a call are independent
// (no destination is read by any copy of the same call), so blocks need no ordering; dst
// and src may be the same buffers (rows of one cache) or different ones (the reorder
// temporary), each with its own strides.
//
// pairs is int64 [3, P]: dst_rows, then src_rows, then n_tokens (one host-to-device copy).
// Launch: grid (P * layers * Hkv, min(65535, ceil(max_n * D / VEC / 128))), block 128;
// grid-stride over the (token, vector) pairs of one (copy, layer, head), so any n is covered.
// Strides are in elements (layer, row, head, token); the head-dim stride is 1 and every
// token row start is VEC-aligned (checked by the planner's caller), offsets are 64-bit.
#include "common.cuh"
// variant.cuh: the code types of quantized caches (quantized_kv.cuh).
#include "variant.cuh"

template <class T, int D>
__global__ void __launch_bounds__(128) gqakv_copy_tokens(
    T* __restrict__ dst_k, T* __restrict__ dst_v,
    const T* __restrict__ src_k, const T* __restrict__ src_v,
    const i64* __restrict__ pairs, int n_pairs, int layers, int Hkv,
    i64 dst_sl, i64 dst_sr, i64 dst_sh, i64 dst_st,
    i64 src_sl, i64 src_sr, i64 src_sh, i64 src_st) {
    constexpr int VEC = VecWidth<T, D>::value;
    constexpr int VPR = D / VEC;  // vectors per token row
    const int h = blockIdx.x % Hkv;
    const int layer = (blockIdx.x / Hkv) % layers;
    const int i = blockIdx.x / (Hkv * layers);
    const i64 n = pairs[2 * (i64)n_pairs + i];
    const i64 total = n * VPR;
    if ((i64)blockIdx.y * blockDim.x >= total) return;  // uniform over the CTA
    const i64 dst = layer * dst_sl + pairs[i] * dst_sr + (i64)h * dst_sh;
    const i64 src = layer * src_sl + pairs[(i64)n_pairs + i] * src_sr + (i64)h * src_sh;
    typedef Vec<T, VEC> V;
    for (i64 idx = (i64)blockIdx.y * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.y * blockDim.x) {
        const i64 t = idx / VPR;
        const int c = (int)(idx % VPR) * VEC;
        const V kv = *reinterpret_cast<const V*>(src_k + src + t * src_st + c);
        const V vv = *reinterpret_cast<const V*>(src_v + src + t * src_st + c);
        *reinterpret_cast<V*>(dst_k + dst + t * dst_st + c) = kv;
        *reinterpret_cast<V*>(dst_v + dst + t * dst_st + c) = vv;
    }
}
