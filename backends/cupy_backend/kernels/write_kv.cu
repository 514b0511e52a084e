// Append: write the new tokens of every batch entry into the cache in place, one launch.
//
// Entry b writes k_new[b, h, t, :] (t < n_new[b]) to k_buf[rows[b], h, starts[b] + t, :],
// and the same for V. Padding slots t >= n_new[b] are never read or written.
// Paged (the KVPages instantiation, paged_kv.cuh): k_buf, v_buf are the page pools and
// token j of row r goes to pool[table[r, j / P], h, j % P, :]; the pages were taken on the
// host before the launch (gqakv.paged.reserve), the kernel only writes into them.
//
// Launch: grid (B * Hkv, min(65535, ceil(Tn * D / VEC / 128))), block 128. Grid-stride over
// the (token, vector) pairs of one (entry, head), so any Tn is covered.
// Strides are in elements; the innermost (head-dim) stride is 1 for all four arrays.
#include "common.cuh"
#include "paged_kv.cuh"

template <class T, int D, class... Pages>
__global__ void __launch_bounds__(128) gqakv_write_kv(
    const T* __restrict__ k_new, const T* __restrict__ v_new,
    T* __restrict__ k_buf, T* __restrict__ v_buf,
    const i64* __restrict__ rows, const i64* __restrict__ starts, const i64* __restrict__ n_new,
    int Hkv, int Tn,
    i64 new_sb, i64 new_sh, i64 new_st,
    i64 buf_sb, i64 buf_sh, i64 buf_st, Pages... pages) {
    constexpr int VEC = VecWidth<T, D>::value;
    constexpr int VPR = D / VEC;  // vectors per token row
    const int b = blockIdx.x / Hkv;
    const int h = blockIdx.x % Hkv;
    const i64 n = n_new[b];
    const i64 src = (i64)b * new_sb + (i64)h * new_sh;
    const i64 row = rows[b], start = starts[b];
    const i64 total = n * VPR;
    for (i64 idx = (i64)blockIdx.y * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.y * blockDim.x) {
        const i64 t = idx / VPR;
        const int c = (int)(idx % VPR) * VEC;
        typedef Vec<T, VEC> V;
        const i64 dst = kv_slot(row, h, start + t, buf_sb, buf_sh, buf_st, pages...);
        *reinterpret_cast<V*>(k_buf + dst + c) =
            *reinterpret_cast<const V*>(k_new + src + t * new_st + c);
        *reinterpret_cast<V*>(v_buf + dst + c) =
            *reinterpret_cast<const V*>(v_new + src + t * new_st + c);
    }
}
