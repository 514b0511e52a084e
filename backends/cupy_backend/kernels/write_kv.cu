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
__global__ void __launch_bounds__(128) gqakv_write_kv(const WriteArgs<T, T> a) {
    constexpr int VEC = VecWidth<T, D>::value;
    constexpr int VPR = D / VEC;  // vectors per token row
    const int b = blockIdx.x / a.Hkv;
    const int h = blockIdx.x % a.Hkv;
    const i64 n = a.n_new[b];
    const i64 src = (i64)b * a.new_sb + (i64)h * a.new_sh;
    const i64 row = a.rows[b], start = a.starts[b];
    const i64 total = n * VPR;
    for (i64 idx = (i64)blockIdx.y * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.y * blockDim.x) {
        const i64 t = idx / VPR;
        const int c = (int)(idx % VPR) * VEC;
        typedef Vec<T, VEC> V;
        const i64 dst = kv_slot(row, h, start + t, a.buf_sb, a.buf_sh, a.buf_st,
                              static_cast<const Pages&>(a.pages)...);
        *reinterpret_cast<V*>(a.k_buf + dst + c) =
            *reinterpret_cast<const V*>(a.k_new + src + t * a.new_st + c);
        *reinterpret_cast<V*>(a.v_buf + dst + c) =
            *reinterpret_cast<const V*>(a.v_new + src + t * a.new_st + c);
    }
}
