// Compile-time traits the attention kernels are composed from:
//   AttnParams      the runtime parameters of a call, one struct passed by value;
//   Variant<FLAGS>  which keys a query sees (key_lo / key_hi, and per pair the mask hook
//                   allowed), how a score is formed (the score hook transform, the scale
//                   folded into it) and the sink term: causal, plus the sliding window,
//                   soft-cap, sinks and ALiBi as compile-time switches (never copies),
//                   and a draft tree's clause (TREE: speculative verification; the
//                   prefill kernels only, masked_score);
//   ContiguousKV    how K and V rows are read (the address arithmetic): contiguous rows of
//                   a dense [rows, Hkv, S, d] cache (PagedKV in paged_kv.cuh reads pages);
//   KernelTypes<T>  the q, K/V and output element types (one storage type today).
// The Python side (plan.py: variant_flags, KernelParams) fills the same struct and picks
// the same flags; gqakv.semantics holds the definitions every path implements.
#pragma once
#include "softmax.cuh"

// Runtime attention parameters: AttnParams (params.cuh, generated from structs.py, which
// also gives plan.KernelParams its NumPy layout). Its fields: the softmax scale; softcap
// c > 0 (read only under VARIANT_SOFTCAP); window W >= 1 (only under VARIANT_WINDOW);
// sinks, [Hq] float32 logits on the device (only under VARIANT_SINKS); k_scale, v_scale, a
// quantized cache's per-token scales (quantized_kv.cuh; null and never read otherwise);
// alibi, [Hq] float32 ALiBi slopes, one per query head (only under VARIANT_ALIBI);
// tree_mask [B, T, T] uint8 (1: chunk token u is query t or one of its ancestors),
// tree_depth [B, T] int64 and tree_stride T, a draft tree (only under VARIANT_TREE).
#include "params.cuh"

// Variant flags (plan.VARIANT_FLAGS spells the same bits).
#define GQAKV_VARIANT_WINDOW 1
#define GQAKV_VARIANT_SOFTCAP 2
#define GQAKV_VARIANT_SINKS 4
#define GQAKV_VARIANT_ALIBI 8
#define GQAKV_VARIANT_TREE 16

template <int FLAGS>
struct Variant {
    static_assert(FLAGS >= 0 && FLAGS < 32, "variant flags: window 1, softcap 2, sinks 4, alibi 8, tree 16");
    static constexpr bool WINDOW = (FLAGS & GQAKV_VARIANT_WINDOW) != 0;
    static constexpr bool SOFTCAP = (FLAGS & GQAKV_VARIANT_SOFTCAP) != 0;
    static constexpr bool SINKS = (FLAGS & GQAKV_VARIANT_SINKS) != 0;
    static constexpr bool ALIBI = (FLAGS & GQAKV_VARIANT_ALIBI) != 0;
    // A draft tree (gqakv.core.tree): chunk query t sees the prefix and its ancestors
    // only, and windows / ALiBi measure logical positions (masked_score). Only the
    // prefill kernels are instantiated with it (instantiations.py).
    static constexpr bool TREE = (FLAGS & GQAKV_VARIANT_TREE) != 0;
    // Whether a raw score needs the score hook at all (kernels skip it otherwise).
    static constexpr bool TRANSFORMS = SOFTCAP || ALIBI;

    // Keys [key_lo(pos), key_hi(pos)) are visible to the query at absolute position pos
    // (gqakv.semantics.key_range): 0 .. pos, or the window's W most recent positions.
    static __device__ __forceinline__ i64 key_lo(const AttnParams& p, i64 pos) {
        if (!WINDOW) return 0;
        const i64 lo = pos - p.window + 1;
        return lo > 0 ? lo : 0;
    }
    static __device__ __forceinline__ i64 key_hi(i64 pos) { return pos + 1; }

    // The mask hook (gqakv.semantics.allowed): whether the query at absolute position
    // q_pos, of query head `head` (every head alike today), sees the key at k_pos; the key
    // range above, per pair (a mask that is no key range would be one more clause here).
    // Padded rows (q_pos -1) see nothing.
    static __device__ __forceinline__ bool allowed(const AttnParams& p, i64 q_pos, i64 k_pos, int) {
        return k_pos < key_hi(q_pos) && (!WINDOW || k_pos >= key_lo(p, q_pos));
    }

    // The factor a raw dot product q . k is multiplied by (kernels fold it into q where q
    // is held in fp32): scale * log2(e) when the score goes straight to the softmax (log2
    // domain, softmax.cuh); the bare scale when the soft-cap must see the natural score.
    static __device__ __forceinline__ float fold(const AttnParams& p) {
        return SOFTCAP ? p.scale : p.scale * GQAKV_LOG2E;
    }
    // Query head h's ALiBi slope in the log2 domain (0 without ALiBi): the key loops read
    // it once per query row and pass it to transform_at.
    static __device__ __forceinline__ float alibi_log2(const AttnParams& p, int h) {
        return ALIBI ? p.alibi[h] * GQAKV_LOG2E : 0.f;
    }
    // The score hook (gqakv.semantics.transform): a folded score x of the query at q_pos
    // (query head `head`) against the key at k_pos, as the softmax takes it (log2 domain,
    // before the mask): x, or the soft-cap c * tanh(x / c) times log2(e); then ALiBi's
    // slope[head] * (k_pos - q_pos) (times log2(e)). x / c, not x * (1 / c): a tiny c
    // saturates tanh instead of making 0 * inf.
    static __device__ __forceinline__ float transform(const AttnParams& p, float x, i64 q_pos,
                                                      i64 k_pos, int head) {
        return transform_at(p, x, alibi_log2(p, head), (float)(k_pos - q_pos));
    }
    // transform with the row's slope already read (alibi_log2) and the key's offset
    // k_pos - q_pos as a float (exact below 2^24): the form the key loops call.
    static __device__ __forceinline__ float transform_at(const AttnParams& p, float x, float slope_log2,
                                                         float dist) {
        if (SOFTCAP) x = (p.softcap * GQAKV_LOG2E) * tanhf(x / p.softcap);
        if (ALIBI) x = fmaf(slope_log2, dist, x);
        return x;
    }
    // ---- the draft tree (TREE; gqakv.core.semantics.tree_visible) ----------------------------
    // Entry b's chunk starts at `start` (P = L - n). Chunk token u stands at the logical
    // position start + depth[b, u] (its position once its path is accepted); a prefix key j
    // at j. Query t sees prefix key j (j < start) and chunk key start + u iff
    // tree_mask[b, t, u]; a window keeps the keys whose logical position is within W of the
    // query's, and ALiBi measures logical distances.
    static __device__ __forceinline__ i64 tree_depth(const AttnParams& p, int b, i64 u) {
        return p.tree_depth[(i64)b * p.tree_stride + u];
    }
    // The position windows and ALiBi measure for chunk token t (start + t; with a tree, its
    // logical start + depth[b, t]).
    static __device__ __forceinline__ i64 query_position(const AttnParams& p, int b, i64 start, i64 t) {
        return TREE ? start + tree_depth(p, b, t) : start + t;
    }
    // The score and mask hooks of the prefill key loops at once: the folded score x of the
    // query at absolute position q_pos (-1: a padded row, which sees nothing) and logical
    // position q_log (query_position; q_pos without a tree) against key j, as the softmax
    // takes it, or -inf where the query does not see the key. Without a tree this is
    // transform_at then allowed, exactly; with one, the tree's clause decides and the key's
    // logical position feeds the window and ALiBi (no tree entry is read for a key past
    // the query or in the prefix).
    static __device__ __forceinline__ float masked_score(const AttnParams& p, float x, float slope_log2,
                                                         i64 q_pos, i64 q_log, int b, i64 start,
                                                         i64 j, int head) {
        if (!TREE) {
            x = transform_at(p, x, slope_log2, (float)(j - q_pos));
            return allowed(p, q_pos, j, head) ? x : GQAKV_NEG_INF;
        }
        if (j >= key_hi(q_pos)) return GQAKV_NEG_INF;  // past the query's own slot (or padding)
        i64 k_log = j;
        if (j >= start) {
            const i64 u = j - start, t = q_pos - start;  // u <= t
            if (p.tree_mask[((i64)b * p.tree_stride + t) * p.tree_stride + u] == 0) return GQAKV_NEG_INF;
            k_log = start + tree_depth(p, b, u);
        }
        if (WINDOW && k_log < q_log - p.window + 1) return GQAKV_NEG_INF;
        return transform_at(p, x, slope_log2, (float)(k_log - q_log));
    }

    // Query head h's sink logit in the log2 domain (-inf: no sink term).
    static __device__ __forceinline__ float sink_log2(const AttnParams& p, int h) {
        return SINKS ? p.sinks[h] * GQAKV_LOG2E : GQAKV_NEG_INF;
    }
};

// Contiguous K/V rows: key `key` of the (cache row, KV head) the reader was made for sits
// at base + key * stride. Kernels ask for whole key rows by key index (never advance a
// pointer), so a page-table reader can stand in with the same two calls. The offset is
// 32-bit (64-bit products cost registers in every kernel): the routing step sends caches
// whose rows span more than limits.MAX_KEY_SPAN elements to the generic path.
template <class TKV>
struct ContiguousKV {
    static constexpr bool SCALED = false;  // no per-key scales (QuantizedKV has them)
    const TKV* __restrict__ k;
    const TKV* __restrict__ v;
    int stride;  // elements between consecutive keys

    __device__ __forceinline__ ContiguousKV(const TKV* __restrict__ k_buf, const TKV* __restrict__ v_buf,
                                            i64 row, int kvh, i64 buf_sb, i64 buf_sh, i64 buf_st)
        : k(k_buf + row * buf_sb + (i64)kvh * buf_sh), v(v_buf + row * buf_sb + (i64)kvh * buf_sh),
          stride((int)buf_st) {}
    // The readers' common constructor (KernelTypes::Reader): the parameters are not needed.
    __device__ __forceinline__ ContiguousKV(const TKV* __restrict__ k_buf, const TKV* __restrict__ v_buf,
                                            i64 row, int kvh, i64 buf_sb, i64 buf_sh, i64 buf_st,
                                            const AttnParams&, int)
        : ContiguousKV(k_buf, v_buf, row, kvh, buf_sb, buf_sh, buf_st) {}
    __device__ __forceinline__ const TKV* k_row(i64 key) const { return k + (int)key * stride; }
    __device__ __forceinline__ const TKV* v_row(i64 key) const { return v + (int)key * stride; }
};

// Element types of one kernel instantiation: q, K/V storage and output. One storage type
// serves all three today; kernels name each role so a quantized K/V type can differ.
template <class T>
struct KernelTypes {
    typedef T Q;
    typedef T KV;
    typedef T Out;
    // How the kernels read K/V over a base layout reader (kv_reader picks the base:
    // ContiguousKV, or PagedKV through a page table); Reader is the contiguous one.
    template <template <class> class Base>
    using ReaderOver = Base<T>;
    typedef ContiguousKV<T> Reader;
};

#include "quantized_kv.cuh"

