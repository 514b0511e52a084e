// Paged K/V: the reader that stands in for ContiguousKV (variant.cuh) when the cache is a
// pool of pages with a page table per row (gqakv.paged), and the one switch the kernels
// use to pick a reader.
//
// Layout (gqakv.paged): K and V pools [num_pages, Hkv, P, d], heads-major inside a page;
// row r's token j of KV head h is at pool[table[r, j / P], h, j % P, :]. The kernels'
// three buffer strides (buf_sb, buf_sh, buf_st) are then the pool's page, head and token
// strides, and the table comes as one more kernel argument, a KVPages by value.
//
// The switch: every kernel that reads or writes K/V ends its parameter list with a pack
// `Pages... pages` (its last template parameter, as CUDA requires of a __global__ pack).
// The contiguous instantiations leave it empty (their names and arguments are unchanged);
// the paged ones name KVPages (sources.paged_name_expression) and the planner appends
// the struct (plan.PageTableArg). kv_reader / kv_slot overload on the pack, so a kernel body says
// `kv_reader<Ty>(k_buf, v_buf, row, kvh, buf_sb, buf_sh, buf_st, params, D, pages...)` once
// and serves both (and, through KernelTypes::ReaderOver, 8-bit codes over either).
//
// Only the pages a row holds for its live tokens are ever looked up (the kernels never
// ask for a key at or past L), so table entries past them (-1) are never read.
#pragma once
#include "variant.cuh"

// The page table as the kernels take it: KVPages (params.cuh, generated from structs.py,
// which also gives plan.PAGES_DTYPE). Its fields: table, [rows, table_stride] int32, row r's
// pages in token order; table_stride, entries per table row (pages_per_row); page_size,
// tokens per page, P >= 1; page_magic, page_shift: key / P as a multiply-high and a shift
// (below).

// key / P for 0 <= key < 2^31 without a division (Granlund and Montgomery's division by an
// invariant integer, "Division by Invariant Integers using Multiplication", PLDI 1994):
// with l = ceil(log2 P) and magic = floor(2^32 (2^l - P) / P) + 1, key / P is
// (mulhi(magic, key) + key) >> l (the sum stays below 2^32 for key < 2^31; P a power of two
// gives magic 1, mulhi 0: a plain shift). A division here costs the decode kernels ~25
// registers (a spill at their occupancy). Rows of 2^31 slots or more stay on the generic
// path (the backend's layout check; plan.PageTableArg refuses them), and
// plan.page_divisor computes the constants.
__device__ __forceinline__ int page_of(const KVPages& p, i64 key) {
    const unsigned k = (unsigned)key;
    const unsigned hi = (unsigned)(((unsigned long long)p.page_magic * k) >> 32);
    return (int)((hi + k) >> p.page_shift);
}

// K/V rows of one (cache row, KV head) through the row's page table: key `key` sits at
// base + table_row[key / P] * page_stride + (key % P) * token_stride. Same two calls as
// ContiguousKV; each costs one table load (cached: consecutive keys share a page).
template <class TKV>
struct PagedKV {
    static constexpr bool SCALED = false;  // no per-key scales (QuantizedKV<C, PagedKV> has them)
    const TKV* __restrict__ k;      // pool + kvh * head stride
    const TKV* __restrict__ v;
    const int* __restrict__ pages;  // the row's table entries
    i64 page_stride, token_stride;
    KVPages p;  // only page_size, page_magic and page_shift stay live

    __device__ __forceinline__ PagedKV(const TKV* __restrict__ k_pool, const TKV* __restrict__ v_pool,
                                       i64 row, int kvh, i64 pool_sp, i64 pool_sh, i64 pool_st,
                                       const KVPages& pg)
        : k(k_pool + (i64)kvh * pool_sh), v(v_pool + (i64)kvh * pool_sh),
          pages(pg.table + row * pg.table_stride), page_stride(pool_sp), token_stride(pool_st), p(pg) {}
    // The readers' common constructor (KernelTypes::ReaderOver): the parameters are not needed.
    __device__ __forceinline__ PagedKV(const TKV* __restrict__ k_pool, const TKV* __restrict__ v_pool,
                                       i64 row, int kvh, i64 pool_sp, i64 pool_sh, i64 pool_st,
                                       const AttnParams&, int, const KVPages& pg)
        : PagedKV(k_pool, v_pool, row, kvh, pool_sp, pool_sh, pool_st, pg) {}

    __device__ __forceinline__ i64 offset(i64 key) const {
        const int j = page_of(p, key);
        return (i64)pages[j] * page_stride + (i64)((int)key - j * p.page_size) * token_stride;
    }
    __device__ __forceinline__ const TKV* k_row(i64 key) const { return k + offset(key); }
    __device__ __forceinline__ const TKV* v_row(i64 key) const { return v + offset(key); }
};

// The reader of a kernel instantiation: its types' reader (KernelTypes<T>::ReaderOver: the
// storage type itself, or QuantizedKV for 8-bit codes with scales, which needs the call's
// scale pointers and d) over the base layout reader: ContiguousKV without pages, PagedKV
// through the table with them. Every (layout, codec) pair is one composition, never a copy.
template <class Ty, class TKV>
__device__ __forceinline__ typename Ty::template ReaderOver<ContiguousKV> kv_reader(
    const TKV* __restrict__ k_buf, const TKV* __restrict__ v_buf, i64 row, int kvh, i64 sb, i64 sh,
    i64 st, const AttnParams& params, int d) {
    return typename Ty::template ReaderOver<ContiguousKV>(k_buf, v_buf, row, kvh, sb, sh, st, params, d);
}
template <class Ty, class TKV>
__device__ __forceinline__ typename Ty::template ReaderOver<PagedKV> kv_reader(
    const TKV* __restrict__ k_buf, const TKV* __restrict__ v_buf, i64 row, int kvh, i64 sb, i64 sh,
    i64 st, const AttnParams& params, int d, const KVPages& pages) {
    return typename Ty::template ReaderOver<PagedKV>(k_buf, v_buf, row, kvh, sb, sh, st, params, d, pages);
}

// Element offset of token `token` of (row, KV head) in the buffer (the writers' address).
__device__ __forceinline__ i64 kv_slot(i64 row, int h, i64 token, i64 sb, i64 sh, i64 st) {
    return row * sb + (i64)h * sh + token * st;
}
__device__ __forceinline__ i64 kv_slot(i64 row, int h, i64 token, i64 sb, i64 sh, i64 st,
                                       const KVPages& p) {
    const int j = page_of(p, token);
    return (i64)p.table[row * p.table_stride + j] * sb + (i64)h * sh + (i64)((int)token - j * p.page_size) * st;
}
