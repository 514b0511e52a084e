// Chunked prefill attention (T > small): FlashAttention-style tiles with online softmax.
//
// One CTA per (entry b, KV head, group chunk, query block). Its ROWS query rows are
// (group head g, token t) pairs: GC heads of the group times BQ tokens (GC * BQ <= ROWS),
// so a K/V tile in shared memory serves every head of the group. Query t of entry b sits
// at absolute position p = L - n + t (bottom-right causal) and sees the keys the variant
// trait allows (variant.cuh: 0..p, or p - W + 1..p; with a draft tree, the prefix and its
// ancestors, windowed by logical positions: Variant::masked_score); key tiles outside the block's span
// are skipped and nothing at or past L is read. Scores and the online softmax are in the
// log2 domain (softmax.cuh): q is scaled by the variant's fold on load.
// Padded rows (t >= n, g >= G) are computed as fully masked and never written.
//
// Threads: 8 row groups x 16 column lanes (tid = tr * 16 + tc); thread (tr, tc) owns rows
// tr * RPT .. + RPT, score columns tc + 16 * jj, output columns tc + 16 * cc. Row max and
// sum reduce over the 16 lanes of a half warp with full-mask xor shuffles.
//
// Launch: grid (B * Hkv * n_gchunks, n_tblocks), block 128.
#include "prefill_common.cuh"
#include "paged_kv.cuh"

template <class T, int D>
struct PrefillShape {
    // Query rows per CTA: limits.PREFILL_ROWS (the planner's table too).
    static constexpr int ROWS = gqakv_lookup_at_most(D, GQAKV_PREFILL_ROWS);
    static_assert(ROWS > 0 && ROWS % 8 == 0, "GQAKV_PREFILL_ROWS: rows for this head dim, 8 row groups");
    static constexpr int BK = D <= 128 ? 32 : 16;                      // keys per tile
    static constexpr int TR = 8, TC = 16;
    static constexpr int RPT = ROWS / TR;          // rows per thread
    static constexpr int SPT = BK / TC;            // score columns per thread
    static constexpr int CPT = (D + TC - 1) / TC;  // output columns per thread
    static constexpr int KSTR = D + 1;             // padded K/V row: conflict-free columns
    static constexpr int DB = 16;                  // head-dim block of one partial dot product
    static constexpr int VEC = VecWidth<T, D>::value;
    static constexpr int NCH = D / VEC;
};

// Key rows row0 .. row0 + nrows of K (IS_V false) or V through the K/V reader, as fp32
// into tile[r * tstride + ...]; rows at or past row_end are zero-filled (never read).
template <class T, int D, bool IS_V, class Reader>
__device__ __forceinline__ void load_tile(float* __restrict__ tile, const Reader& kv,
                                          i64 row0, i64 row_begin, i64 row_end, int nrows,
                                          int tstride) {
    typedef PrefillShape<T, D> S;
    for (int idx = threadIdx.x; idx < nrows * S::NCH; idx += blockDim.x) {
        const int r = idx / S::NCH, ch = idx % S::NCH;
        float* dst = tile + r * tstride + ch * S::VEC;
        if (row0 + r >= row_begin && row0 + r < row_end) {  // outside: zeros, never read
            const T* src = IS_V ? kv.v_row(row0 + r) : kv.k_row(row0 + r);
            ValueLoad<T, S::VEC>::load(src, ch * S::VEC, dst);
            if constexpr (Reader::SCALED) {  // quantized: this tile's row dequantized as it lands
                const float sc = IS_V ? kv.v_scale(row0 + r, ch * S::VEC) : kv.k_scale(row0 + r, ch * S::VEC);
#pragma unroll
                for (int e = 0; e < S::VEC; ++e) dst[e] *= sc;
            }
        } else {
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) dst[e] = 0.f;
        }
    }
}

// T: the storage type (KernelTypes names its q / K/V / output roles); VARIANT: the
// variant trait's flags (variant.cuh; 0 is plain causal).
template <class T, int D, int VARIANT = 0, class... Pages>
__global__ void __launch_bounds__(128, 1) gqakv_prefill(
    const typename KernelTypes<T>::Q* __restrict__ q, const typename KernelTypes<T>::KV* __restrict__ k_buf,
    const typename KernelTypes<T>::KV* __restrict__ v_buf,
    const i64* __restrict__ rows, const i64* __restrict__ lens, const i64* __restrict__ n_new,
    typename KernelTypes<T>::Out* __restrict__ out, float* __restrict__ lse,
    int Hkv, int G, int Tq, int GC, int BQ, int n_gchunks, AttnParams params,
    i64 q_sb, i64 q_sh, i64 q_st, i64 buf_sb, i64 buf_sh, i64 buf_st,
    i64 o_sb, i64 o_sh, i64 o_st, Pages... pages) {
    typedef KernelTypes<T> Ty;
    typedef typename Ty::KV KV;
    typedef PrefillShape<KV, D> S;
    typedef Variant<VARIANT> V;
    const PrefillCta cta = prefill_cta<V>(lens, n_new, Hkv, n_gchunks, BQ, params);
    const int gc = cta.gc, kvh = cta.kvh, b = cta.b, t0 = cta.t0;
    const i64 n = cta.n, start = cta.start, k_begin = cta.k_begin, k_end = cta.k_end;
    if (t0 >= n) return;  // uniform over the CTA

    __shared__ float sQ[S::ROWS][D];
    __shared__ float sKV[S::BK * S::KSTR];
    __shared__ float sP[S::ROWS][S::BK];

    // Load the query rows, scaled by the variant's fold; padded rows are zero (and fully
    // masked below).
    const float qscale = V::fold(params);
    for (int idx = threadIdx.x; idx < S::ROWS * S::NCH; idx += blockDim.x) {
        const int r = idx / S::NCH, ch = idx % S::NCH;
        const int gi = r / BQ, t = t0 + r % BQ, g = gc * GC + gi;
        float* dst = &sQ[r][ch * S::VEC];
        if (gi < GC && g < G && t < n) {
            load_vec<typename Ty::Q, S::VEC>(q + (i64)b * q_sb + (i64)(kvh * G + g) * q_sh +
                                                 (i64)t * q_st + ch * S::VEC, dst);
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) dst[e] *= qscale;
        } else {
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) dst[e] = 0.f;
        }
    }

    const int tr = threadIdx.x / S::TC, tc = threadIdx.x % S::TC;
    i64 pos[S::RPT];  // absolute position of each owned row; -1 for padding
    i64 q_log[S::RPT];  // the position its window and ALiBi measure (a tree's logical one)
    int head[S::RPT];  // its query head
    float slope[S::RPT];  // its head's ALiBi slope, log2 domain (0 without ALiBi)
    SoftmaxState<false> st[S::RPT];
    float acc[S::RPT][S::CPT];
#pragma unroll
    for (int i = 0; i < S::RPT; ++i) {
        const int r = tr * S::RPT + i;
        const int gi = r / BQ, t = t0 + r % BQ, g = gc * GC + gi;
        pos[i] = (gi < GC && g < G && t < n) ? start + t : -1;
        q_log[i] = pos[i] < 0 ? -1 : V::query_position(params, b, start, t);
        head[i] = kvh * G + g;
        slope[i] = pos[i] < 0 ? 0.f : V::alibi_log2(params, head[i]);
        st[i].init();
#pragma unroll
        for (int cc = 0; cc < S::CPT; ++cc) acc[i][cc] = 0.f;
    }

    const auto kv = kv_reader<Ty>(k_buf, v_buf, rows[b], kvh, buf_sb, buf_sh, buf_st, params, D, pages...);
    // Key tiles start at a multiple of BK (a window's start rounded down; the slots before
    // it are zeros, never read, and masked): a query's tiles are then the same whatever
    // block it is in, so its bits do not depend on its chunk (batch-invariant mode).
    for (i64 j0 = k_begin - k_begin % S::BK; j0 < k_end; j0 += S::BK) {
        __syncthreads();  // previous tile's readers are done with sKV and sP
        load_tile<KV, D, false>(sKV, kv, j0, k_begin, k_end, S::BK, S::KSTR);
        __syncthreads();

        // Dot products in blocks of DB head-dim elements, each block summed on its own and
        // then added: one fp32 chain over all of d = 256 puts ~2e-6 of rounding into the
        // outputs (the suites' fp32 accumulation budget); blocks cut it ~3x.
        float s[S::RPT][S::SPT];
#pragma unroll
        for (int i = 0; i < S::RPT; ++i)
#pragma unroll
            for (int jj = 0; jj < S::SPT; ++jj) s[i][jj] = 0.f;
        for (int d0 = 0; d0 < D; d0 += S::DB) {
            float sb[S::RPT][S::SPT];
#pragma unroll
            for (int i = 0; i < S::RPT; ++i)
#pragma unroll
                for (int jj = 0; jj < S::SPT; ++jj) sb[i][jj] = 0.f;
#pragma unroll 2
            for (int d = d0; d < (d0 + S::DB < D ? d0 + S::DB : D); ++d) {
                float kv[S::SPT];
#pragma unroll
                for (int jj = 0; jj < S::SPT; ++jj) kv[jj] = sKV[(tc + S::TC * jj) * S::KSTR + d];
#pragma unroll
                for (int i = 0; i < S::RPT; ++i) {
                    const float qv = sQ[tr * S::RPT + i][d];
#pragma unroll
                    for (int jj = 0; jj < S::SPT; ++jj) sb[i][jj] += qv * kv[jj];
                }
            }
#pragma unroll
            for (int i = 0; i < S::RPT; ++i)
#pragma unroll
                for (int jj = 0; jj < S::SPT; ++jj) s[i][jj] += sb[i][jj];
        }

#pragma unroll
        for (int i = 0; i < S::RPT; ++i) {
            float row_max = GQAKV_NEG_INF;
#pragma unroll
            for (int jj = 0; jj < S::SPT; ++jj) {
                const i64 j = j0 + tc + S::TC * jj;
                // The variant's score and mask hooks (a draft tree's clause too); padded
                // rows (pos -1) mask all.
                s[i][jj] = V::masked_score(params, s[i][jj], slope[i], pos[i], q_log[i], b, start, j,
                                           head[i]);
                row_max = fmaxf(row_max, s[i][jj]);
            }
            row_max = group_max<S::TC>(row_max);
            // A row that has seen no visible key keeps the empty state (no -inf - -inf: its
            // masked scores get 2^(-inf - 0) = 0). fmaxf skips NaN scores, but 2^(NaN - mu)
            // is NaN: l, then out and lse, turn NaN (never 0 / -inf) and stay so.
            const float corr = st[i].raise(row_max);
            const float mu = st[i].base();
            float p_sum = 0.f;
#pragma unroll
            for (int jj = 0; jj < S::SPT; ++jj) {
                const float p = st[i].weight(s[i][jj], mu);
                sP[tr * S::RPT + i][tc + S::TC * jj] = p;
                p_sum += p;
            }
            p_sum = group_sum<S::TC>(p_sum);
            st[i].l += p_sum;
#pragma unroll
            for (int cc = 0; cc < S::CPT; ++cc) acc[i][cc] *= corr;
        }

        __syncthreads();  // everyone is done reading K
        load_tile<KV, D, true>(sKV, kv, j0, k_begin, k_end, S::BK, S::KSTR);
        __syncthreads();

#pragma unroll 4
        for (int kk = 0; kk < S::BK; ++kk) {
#pragma unroll
            for (int i = 0; i < S::RPT; ++i) {
                const float p = sP[tr * S::RPT + i][kk];
#pragma unroll
                for (int cc = 0; cc < S::CPT; ++cc) {
                    const int col = tc + S::TC * cc;
                    if (col < D) acc[i][cc] += p * sKV[kk * S::KSTR + col];
                }
            }
        }
    }

    const int Hq = Hkv * G;
#pragma unroll
    for (int i = 0; i < S::RPT; ++i) {
        if (pos[i] < 0) continue;
        const int r = tr * S::RPT + i;
        const int g = gc * GC + r / BQ, t = t0 + r % BQ, h = kvh * G + g;
        // The sink term joins once, after every key (none without the sinks variant).
        float mx = st[i].m, total = st[i].l;
        const float corr = V::SINKS ? add_sink_log2(mx, total, V::sink_log2(params, h)) : 1.f;
        const float inv = corr / total;  // total > 0 (every real query sees its own key), or NaN
        typename Ty::Out* o = out + (i64)b * o_sb + (i64)h * o_sh + (i64)t * o_st;
#pragma unroll
        for (int cc = 0; cc < S::CPT; ++cc) {
            const int col = tc + S::TC * cc;
            if (col < D) o[col] = from_float<typename Ty::Out>(acc[i][cc] * inv);
        }
        if (tc == 0) lse[((i64)b * Hq + h) * Tq + t] = finished_lse(mx, total);
    }
}
