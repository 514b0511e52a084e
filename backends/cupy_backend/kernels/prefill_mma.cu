// Chunked prefill attention on tensor cores, for float16 / bfloat16 and head dims that are
// a multiple of 16: S = Q K^T and O += P V with mma.m16n8k16 (fp32 accumulation, sm_80+).
//
// Same work split and semantics as gqakv_prefill (prefill.cu): one CTA per (entry b, KV
// head, group chunk, query block); its ROWS = 64 query rows are (group head g, token t)
// pairs, GC heads times BQ tokens (GC * BQ <= 64). Query t of entry b sits at absolute
// position L - n + t and sees the keys of the variant trait (variant.cuh; a draft tree's
// clause too, Variant::masked_score); key tiles
// outside the block's span are skipped, nothing at or past L is read, and padded rows (t >= n, g >= G) are
// fully masked and never written. Offsets are 64-bit.
//
// Warps: 4, warp w owns query rows 16w..16w+15 (the M of every mma). Per key tile of BK keys:
//   S (16 x BK per warp) = Q K^T: D/16 k-steps x BK/8 mma over Q and K in shared memory,
//       then scaled in fp32 by the variant's fold and transformed by its score modifier
//       (log2 domain, softmax.cuh; Q stays unscaled in 16 bits, so no extra rounding);
//   online softmax in registers: each lane holds rows groupID and groupID + 8 and two
//       columns per 8-key n-tile; row max / sum reduce over the 4 lanes of a quad;
//   P is rounded to T (as FlashAttention does) and reused straight from the S accumulators
//       as the A fragments of P V (the C layout of two n-tiles is the A layout of one k-step);
//       two denominators: l sums the fp32 P (the LSE carries no 16-bit rounding) and lr the
//       rounded P that P V actually used, so out = sum(P~ V) / sum(P~) is a weighted mean of
//       V rows (in a NumPy model of both choices on 4-key causal rows, the worst error over
//       the tests' tolerance fell from 1.34 to 1.12 in float16, 1.12 to 1.07 in bfloat16);
//   O (16 x D per warp) += P V: BK/16 k-steps x D/8 mma, V read transposed from shared memory.
// A warp whose rows see no key of the tile (every row's last visible key < the tile's first
// key, or all rows padding) skips its mma for that tile: its state would not change.
//
// Shared memory holds 32-bit words of two packed 16-bit elements: Q [64][D + 8], K [BK][D + 8]
// and V transposed, Vt [D][BK + 8] (key pairs packed per word). The 8-element row padding
// keeps every fragment load conflict-free (row strides of 4 mod 32 words, or 12/20 for Vt).
// When Q, K and Vt do not fit the 48 KiB of static shared memory together (D > 224), K and
// V take turns in one buffer.
//
// Cost per warp and key tile (estimate, not measured): 64 * D * BK mma FLOPs against
// 4 * D * BK + 32 * D bytes of shared-memory fragment loads (P never leaves registers), i.e.
// 16 * BK / (BK + 8) FLOP per byte: 14.2 at BK = 64, 12.8 at 32, 10.7 at 16; about 9 to 11
// counting the tile stores (gqakv_prefill's fp32 FMA loop: about 1).
//
// Launch: grid (B * Hkv * n_gchunks, n_tblocks), block 128.
#include "prefill_common.cuh"
#include "paged_kv.cuh"
#include "mma.cuh"

template <int D, int BK, bool KV_SHARED>
struct PrefillMmaSmem {
    static constexpr int QW = (D + 8) / 2;   // words per Q row
    static constexpr int KW = (D + 8) / 2;   // words per K row
    static constexpr int VW = (BK + 8) / 2;  // words per Vt row (one head-dim column of V)
    static constexpr int K_WORDS = BK * KW, V_WORDS = D * VW;
    static constexpr int KV_WORDS = KV_SHARED ? gqakv_cmax(K_WORDS, V_WORDS) : K_WORDS + V_WORDS;
    static_assert(QW % 4 == 0 && KW % 4 == 0 && VW % 4 == 0, "rows of whole 16-byte chunks");
    static constexpr int BYTES = 4 * (64 * QW + KV_WORDS);
    static constexpr bool FITS = BYTES <= 48 * 1024;
};

template <class T, int D>
struct PrefillMmaShape {
    static_assert(sizeof(T) == 2 && D % 16 == 0 && D > 0, "16-bit types, head dim a multiple of 16");
    static_assert(GQAKV_PREFILL_MMA_HEAD_DIM_MULTIPLE == 16, "the mma's k is 16");
    static constexpr int WARPS = 4;
    static_assert(WARPS * 32 == GQAKV_THREADS_PER_CTA, "4 warps per CTA");
    static constexpr int ROWS = 16 * WARPS;  // query rows per CTA
    static_assert(ROWS == GQAKV_PREFILL_MMA_ROWS, "limits.PREFILL_MMA_ROWS is 4 warps x the mma's 16 rows");
    // Largest key tile with K and V in separate buffers that fits, else 16 keys sharing one.
    static constexpr int BK = PrefillMmaSmem<D, 64, false>::FITS ? 64
                              : PrefillMmaSmem<D, 32, false>::FITS ? 32 : 16;
    static constexpr bool KV_SHARED = !PrefillMmaSmem<D, 16, false>::FITS;
    typedef PrefillMmaSmem<D, BK, KV_SHARED> Smem;
    static_assert(Smem::FITS, "prefill tiles exceed 48 KiB of shared memory");
    static constexpr int NT_S = BK / 8;   // 8-key n-tiles of S
    static constexpr int NT_O = D / 8;    // 8-column n-tiles of O
    static constexpr int KS_D = D / 16;   // k-steps of Q K^T
    static constexpr int KS_K = BK / 16;  // k-steps of P V
    static constexpr int NCH = D / 8;     // 16-byte chunks per head-dim row
    // Resident CTAs per SM the register budget must allow (<= 168 registers at 3, <= 255 at 2).
    static constexpr int MIN_CTAS = D <= 128 ? 3 : 2;
};

struct alignas(16) Words4 {
    unsigned w[4];
};

// K rows row0 .. row0 + nrows (16-bit, through the K/V reader) into shared words
// dst[r * dst_words + ...], rows before row_begin or at or past row_end zero-filled (never read).
template <class T, int D, class Reader>
__device__ __forceinline__ void load_rows_16(unsigned* __restrict__ dst, int dst_words,
                                             const Reader& kv, i64 row0, i64 row_begin, i64 row_end,
                                             int nrows) {
    constexpr int NCH = D / 8;
    for (int idx = threadIdx.x; idx < nrows * NCH; idx += blockDim.x) {
        const int r = idx / NCH, ch = idx % NCH;
        Words4 x = {{0u, 0u, 0u, 0u}};
        if (row0 + r >= row_begin && row0 + r < row_end)
            x = *reinterpret_cast<const Words4*>(kv.k_row(row0 + r) + ch * 8);
        *reinterpret_cast<Words4*>(dst + r * dst_words + ch * 4) = x;
    }
}

// V rows row0 .. row0 + BK, transposed: dst[c * VW + k / 2] packs V[k][c] (low half) and
// V[k + 1][c] (high half), the k-pair of a B fragment register. Lanes run over key pairs,
// so the scattered 32-bit stores hit distinct banks.
template <class T, int D, int BK, int VW, class Reader>
__device__ __forceinline__ void load_v_transposed(unsigned* __restrict__ dst, const Reader& kv,
                                                  i64 row0, i64 row_begin, i64 row_end) {
    constexpr int NCH = D / 8, PAIRS = BK / 2;
    for (int idx = threadIdx.x; idx < PAIRS * NCH; idx += blockDim.x) {
        const int kp = idx % PAIRS, ch = idx / PAIRS;
        const i64 k0 = row0 + 2 * kp;
        Words4 lo = {{0u, 0u, 0u, 0u}}, hi = {{0u, 0u, 0u, 0u}};
        if (k0 >= row_begin && k0 < row_end) lo = *reinterpret_cast<const Words4*>(kv.v_row(k0) + ch * 8);
        if (k0 + 1 >= row_begin && k0 + 1 < row_end)
            hi = *reinterpret_cast<const Words4*>(kv.v_row(k0 + 1) + ch * 8);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const unsigned a = (lo.w[e / 2] >> (16 * (e % 2))) & 0xffffu;
            const unsigned b = (hi.w[e / 2] >> (16 * (e % 2))) & 0xffffu;
            dst[(ch * 8 + e) * VW + kp] = a | (b << 16);
        }
    }
}

// T: the storage type (q and K/V enter the mma together, so KernelTypes' Q and KV are the
// same here); VARIANT: the variant trait's flags (variant.cuh; 0 is plain causal).
template <class T, int D, int VARIANT = 0, class... Pages>
__global__ void __launch_bounds__(128, PrefillMmaShape<T, D>::MIN_CTAS) gqakv_prefill_mma(
    const typename KernelTypes<T>::Q* __restrict__ q, const typename KernelTypes<T>::KV* __restrict__ k_buf,
    const typename KernelTypes<T>::KV* __restrict__ v_buf,
    const i64* __restrict__ rows, const i64* __restrict__ lens, const i64* __restrict__ n_new,
    typename KernelTypes<T>::Out* __restrict__ out, float* __restrict__ lse,
    int Hkv, int G, int Tq, int GC, int BQ, int n_gchunks, AttnParams params,
    i64 q_sb, i64 q_sh, i64 q_st, i64 buf_sb, i64 buf_sh, i64 buf_st,
    i64 o_sb, i64 o_sh, i64 o_st, Pages... pages) {
    typedef KernelTypes<T> Ty;
    typedef typename Ty::KV KV;
    typedef PrefillMmaShape<KV, D> S;
    typedef typename S::Smem M;
    typedef Variant<VARIANT> V;
    const PrefillCta cta = prefill_cta<V>(lens, n_new, Hkv, n_gchunks, BQ, params);
    const int gc = cta.gc, kvh = cta.kvh, b = cta.b, t0 = cta.t0;
    const i64 n = cta.n, start = cta.start, k_begin = cta.k_begin, k_end = cta.k_end;
    if (t0 >= n) return;  // uniform over the CTA

    // Words4 storage: 16-byte aligned (QW, KW, VW are multiples of 4 words, so is K_WORDS).
    __shared__ Words4 sQ4[S::ROWS * M::QW / 4];
    __shared__ Words4 sKV4[M::KV_WORDS / 4];
    unsigned* const sQ = reinterpret_cast<unsigned*>(sQ4);
    unsigned* const sKV = reinterpret_cast<unsigned*>(sKV4);
    unsigned* const sK = sKV;
    unsigned* const sVt = S::KV_SHARED ? sKV : sKV + M::K_WORDS;

    // Query rows, unscaled 16-bit; padded rows are zero (and fully masked below).
    for (int idx = threadIdx.x; idx < S::ROWS * S::NCH; idx += blockDim.x) {
        const int r = idx / S::NCH, ch = idx % S::NCH;
        const int gi = r / BQ, t = t0 + r % BQ, g = gc * GC + gi;
        Words4 x = {{0u, 0u, 0u, 0u}};
        if (gi < GC && g < G && t < n)
            x = *reinterpret_cast<const Words4*>(q + (i64)b * q_sb + (i64)(kvh * G + g) * q_sh +
                                                 (i64)t * q_st + ch * 8);
        *reinterpret_cast<Words4*>(sQ + r * M::QW + ch * 4) = x;
    }

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int grp = lane >> 2, tig = lane % 4;  // the fragment layout's groupID, threadID_in_group
    const int r0 = warp * 16;                   // first query row of this warp
    i64 pos[2];  // absolute position of rows r0 + grp (h = 0) and r0 + grp + 8 (h = 1); -1: padding
    i64 q_log[2];  // the positions their windows and ALiBi measure (a tree's logical ones)
    int head[2];  // their query heads
    float slope[2];  // their heads' ALiBi slopes, log2 domain (0 without ALiBi)
    SoftmaxState<false> st[2];  // running max and sum of fp32 P
    float lr[2];  // sum of P rounded to T
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r0 + grp + 8 * h;
        const int gi = r / BQ, t = t0 + r % BQ, g = gc * GC + gi;
        pos[h] = (gi < GC && g < G && t < n) ? start + t : -1;
        q_log[h] = pos[h] < 0 ? -1 : V::query_position(params, b, start, t);
        head[h] = kvh * G + g;
        slope[h] = pos[h] < 0 ? 0.f : V::alibi_log2(params, head[h]);
        st[h].init();
        lr[h] = 0.f;
    }
    // The warp's last visible key (-1 when all its rows are padding), for skipping tiles.
    i64 warp_last = pos[0] > pos[1] ? pos[0] : pos[1];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
        const i64 other = __shfl_xor_sync(GQAKV_FULL_MASK, warp_last, off);
        warp_last = other > warp_last ? other : warp_last;
    }
    float o[S::NT_O][4];
#pragma unroll
    for (int nt = 0; nt < S::NT_O; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[nt][i] = 0.f;

    const auto kv = kv_reader<Ty>(k_buf, v_buf, rows[b], kvh, buf_sb, buf_sh, buf_st, params, D, pages...);
    const float qscale = V::fold(params);
    // Key tiles start at a multiple of BK (a window's start rounded down; the slots before
    // it are zeros, never read, and masked): a query's tiles are then the same whatever
    // block it is in, so its bits do not depend on its chunk (batch-invariant mode).
    for (i64 j0 = k_begin - k_begin % S::BK; j0 < k_end; j0 += S::BK) {
        __syncthreads();  // previous tile's readers are done with sKV
        load_rows_16<KV, D>(sK, M::KW, kv, j0, k_begin, k_end, S::BK);
        if (!S::KV_SHARED)
            load_v_transposed<KV, D, S::BK, M::VW>(sVt, kv, j0, k_begin, k_end);
        __syncthreads();
        const bool active = j0 <= warp_last;  // uniform over the warp

        unsigned pa[S::KS_K][4];  // P as the A fragments of P V
        if (active) {
            float s[S::NT_S][4];
#pragma unroll
            for (int nt = 0; nt < S::NT_S; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
#pragma unroll
            for (int ks = 0; ks < S::KS_D; ++ks) {
                const unsigned* qa = sQ + (r0 + grp) * M::QW + ks * 8 + tig;
                const unsigned a[4] = {qa[0], qa[8 * M::QW], qa[4], qa[8 * M::QW + 4]};
#pragma unroll
                for (int nt = 0; nt < S::NT_S; ++nt) {
                    const unsigned* kb = sK + (nt * 8 + grp) * M::KW + ks * 8 + tig;
                    const unsigned bb[2] = {kb[0], kb[4]};
                    mma_m16n8k16<T>(s[nt], a, bb);
                }
            }

#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float row_max = GQAKV_NEG_INF;
                // ALiBi: this lane's first key of the tile from the row's position (a float
                // per tile, not an i64 per key: the kernel is at its register budget)
                const float dist0 = V::ALIBI && !V::TREE ? (float)(j0 + 2 * tig - pos[h]) : 0.f;
#pragma unroll
                for (int nt = 0; nt < S::NT_S; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const i64 j = j0 + nt * 8 + 2 * tig + e;
                        // The variant's score and mask hooks; padded rows (pos -1) mask all.
                        float x;
                        if constexpr (V::TREE) {  // the tree's clause, logical distances
                            x = V::masked_score(params, s[nt][2 * h + e] * qscale, slope[h], pos[h],
                                                q_log[h], b, start, j, head[h]);
                        } else {
                            x = V::transform_at(params, s[nt][2 * h + e] * qscale, slope[h],
                                                dist0 + (float)(nt * 8 + e));
                            if (!V::allowed(params, pos[h], j, head[h])) x = GQAKV_NEG_INF;
                        }
                        s[nt][2 * h + e] = x;
                        row_max = fmaxf(row_max, x);
                    }
                row_max = group_max<4>(row_max);
                // A row that has seen no visible key keeps the empty state (no -inf - -inf:
                // its masked scores get 2^(-inf - 0) = 0). fmaxf skips NaN scores, but
                // 2^(NaN - mu) is NaN: l and lr, then out and lse, turn NaN and stay so.
                const float corr = st[h].raise(row_max);
                const float mu = st[h].base();
                float p_sum = 0.f, pr_sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < S::NT_S; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = st[h].weight(s[nt][2 * h + e], mu);
                        const float pr = to_float(from_float<T>(p));  // what P V will use
                        s[nt][2 * h + e] = pr;
                        p_sum += p;
                        pr_sum += pr;
                    }
                p_sum = group_sum<4>(p_sum);
                pr_sum = group_sum<4>(pr_sum);
                st[h].l += p_sum;  // raise() rescaled it
                lr[h] = lr[h] * corr + pr_sum;
#pragma unroll
                for (int nt = 0; nt < S::NT_O; ++nt) {
                    o[nt][2 * h] *= corr;
                    o[nt][2 * h + 1] *= corr;
                }
            }
#pragma unroll
            for (int ks = 0; ks < S::KS_K; ++ks) {
                pa[ks][0] = pack2<T>(s[2 * ks][0], s[2 * ks][1]);          // row g,   keys 2t..
                pa[ks][1] = pack2<T>(s[2 * ks][2], s[2 * ks][3]);          // row g+8, keys 2t..
                pa[ks][2] = pack2<T>(s[2 * ks + 1][0], s[2 * ks + 1][1]);  // row g,   keys 2t+8..
                pa[ks][3] = pack2<T>(s[2 * ks + 1][2], s[2 * ks + 1][3]);  // row g+8, keys 2t+8..
            }
        }

        if (S::KV_SHARED) {
            __syncthreads();  // everyone is done reading K
            load_v_transposed<KV, D, S::BK, M::VW>(sVt, kv, j0, k_begin, k_end);
            __syncthreads();
        }
        if (active) {
#pragma unroll
            for (int ks = 0; ks < S::KS_K; ++ks) {
#pragma unroll
                for (int nt = 0; nt < S::NT_O; ++nt) {
                    const unsigned* vb = sVt + (nt * 8 + grp) * M::VW + ks * 8 + tig;
                    const unsigned bb[2] = {vb[0], vb[4]};
                    mma_m16n8k16<T>(o[nt], pa[ks], bb);
                }
            }
        }
    }

    const int Hq = Hkv * G;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (pos[h] < 0) continue;
        const int r = r0 + grp + 8 * h;
        const int g = gc * GC + r / BQ, t = t0 + r % BQ, hq = kvh * G + g;
        // The sink term joins once, after every key, in both denominators (none without the
        // sinks variant): lr by the same factor and weight as l.
        float mx = st[h].m, total = st[h].l, denom = lr[h], corr = 1.f;
        if (V::SINKS) {
            const float sink = V::sink_log2(params, hq);
            float m_r = mx;
            corr = add_sink_log2(mx, total, sink);
            add_sink_log2(m_r, denom, sink);
        }
        // lr >= 1 (every real query sees its own key, P = 1 at the max), or NaN.
        const float inv = corr / denom;
        typedef typename Ty::Out TO;
        TO* orow = out + (i64)b * o_sb + (i64)hq * o_sh + (i64)t * o_st;
#pragma unroll
        for (int nt = 0; nt < S::NT_O; ++nt) {
            Vec<TO, 2> pair;
            pair.v[0] = from_float<TO>(o[nt][2 * h] * inv);
            pair.v[1] = from_float<TO>(o[nt][2 * h + 1] * inv);
            *reinterpret_cast<Vec<TO, 2>*>(orow + nt * 8 + 2 * tig) = pair;
        }
        if (tig == 0) lse[((i64)b * Hq + hq) * Tq + t] = finished_lse(mx, total);
    }
}
