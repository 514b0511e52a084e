// Decode attention on tensor cores (float16 / bfloat16 K and V, head dims 64 and 128).
//
// Same launch, arguments, split and output contract as gqakv_decode (decode.cu): one CTA
// per (entry b, KV head, query chunk, split; splits start at the entry's first visible key),
// nothing at or past L = lens[b] read, query t at position L - n + t seeing the keys of the
// variant trait (variant.cuh), fp32 partials plus natural-log LSE for gqakv_merge when split. Only the math inside a CTA differs; the query chunk is 16 rows
// (the mma's m), so G * T <= 16 (every Llama-style decode) takes one chunk.
//
// Why tensor cores for a bandwidth-bound kernel: the fp32-FMA kernel issues ~170 warp
// instructions per KB of K and V at a 4-query tile (dot products and P V on the FMA pipe,
// shuffle reductions, conversions); at 80% of an H200's 4.8 TB/s an SM must consume ~17
// bytes per clock, i.e. ~2.8 instructions per clock per SM: issue-bound below the target.
// Here a warp step of 16 keys (8 KB at d = 128) is 16 mma for the scores, 32 for P V,
// 32 byte permutes and ~70 other instructions: ~20 per KB, far from any issue limit.
//
// Fragments (mma.cuh; g = lane / 4, c = lane % 4):
//   S = Q K^T, per step two n8 tiles (keys 0..7, 8..15): A = Q (16 rows x 16 of d),
//   B = K^T (16 of d x 8 keys). The order of d inside the products is free (it is summed),
//   so lane (g, c) takes the 16-byte chunks d in [32 i + 8 c, 32 i + 8 c + 8), i < D/32, of
//   Q rows g, g + 8 and of key g of each tile: loads straight into fragment registers, no
//   shuffles, and one load instruction reads whole 64-byte runs of 8 key rows (no sector is
//   fetched half by one instruction and half by the next).
//   O += P V: A = P (16 rows x 16 keys) is exactly the two score tiles' C fragments (the
//   register reuse of FlashAttention-2); B = V (16 keys x 8 of d). The order of output d
//   is free too: lane (g, c) loads the chunks d in [64 i + 8 g, 64 i + 8 g + 8), i < D/64,
//   of keys 2c, 2c + 1, 2c + 8, 2c + 9 (one load instruction: 128 contiguous bytes of 4 key
//   rows), pairs the two keys of each B register with a byte permute, and output column j
//   of n8 block nb is d = 64 (nb / 8) + 8 j + nb % 8.
// Softmax: scores from the mma are fp32, scaled by the variant's fold and transformed by its
// score modifier (log2 domain, softmax.cuh); a row's max over a step takes two xor shuffles among its 4 lanes; its state
// is rescaled only when the max grows. Row sums stay per lane until the end.
// Precision: K, V and Q enter the mma exactly; every product is accumulated in fp32. A
// weight p in [0, 1] is split into hi = round16(p) and lo = round16(p - hi) and P V runs
// as two mma, so weights keep ~16 significant bits (relative error ~2^-17 for bf16).
//
// Bytes in flight: a warp issues a step's K (4 KB at d = 128) and V (4 KB) as 16 16-byte
// loads per lane; the next step's K is issued as soon as the scores are in registers and
// its V right after P V, so 4..8 KB per warp stay outstanding: 32..64 KB per SM at the 2
// resident CTAs of d = 128 (Little's law asks ~25-40 KB per SM for 4.8 TB/s at ~0.6-1 us).
//
// Launch: grid (B * Hkv * n_qchunks, num_splits), block 128 (4 warps, each streaming
// every 4th 16-key block of the split).
#include "decode_common.cuh"
#include "paged_kv.cuh"
#include "mma.cuh"

template <class T, int D>
struct DecodeMmaShape {
    static_assert(gqakv_one_of(D, GQAKV_DECODE_MMA_HEAD_DIMS),
                  "gqakv_decode_mma serves the head dims of GQAKV_DECODE_MMA_HEAD_DIMS");
    static constexpr int WARPS = 4;
    static_assert(WARPS * 32 == GQAKV_THREADS_PER_CTA, "4 warps per CTA");
    static constexpr int QB = 16;      // query rows per CTA (the mma's m)
    static_assert(QB == GQAKV_DECODE_MMA_ROWS, "the planner's query chunk is the mma's 16 rows");
    static constexpr int KEYS = 16;    // keys per warp step (the k of P V)
    static constexpr int KK = D / 16;  // k16 steps of Q K^T
    static constexpr int NB = D / 8;   // n8 blocks of P V (= V elements per lane and key)
    static constexpr int KW = D / 8;   // 32-bit words of K (D / 32 chunks of 8) per lane and key
    static constexpr int VW = D / 16;  // 32-bit words of V (D / 64 chunks of 8) per lane and key
    // Resident CTAs per SM (registers: ~2 x 64 of K/V words and O fragments at d = 128):
    // limits.DECODE_MMA_CTAS_PER_SM, which the split planner also reads.
    static constexpr int CTAS_PER_SM = gqakv_lookup(D, GQAKV_DECODE_MMA_CTAS_PER_SM);
    static_assert(CTAS_PER_SM > 0, "no GQAKV_DECODE_MMA_CTAS_PER_SM entry for this head dim");
    // The occupancy a variant's instantiation is bounded by: ALiBi's per-row slope and
    // position (and the distance per score) left the d = 64 tile at 128 registers spilling
    // 8-20 bytes with every feature on (sm_80 / sm_90, NVRTC's ptxas), so an ALiBi
    // instantiation keeps at most 3 CTAs per SM (170 registers). The split planner still
    // assumes CTAS_PER_SM: a heuristic for how many splits fill the GPU, not a limit.
};
template <class T, int D, int VARIANT>
struct DecodeMmaCtas {  // (DecodeMmaShape's note on ALiBi's occupancy)
    static constexpr int BASE = DecodeMmaShape<T, D>::CTAS_PER_SM;
    static constexpr int value = (VARIANT & GQAKV_VARIANT_ALIBI) && BASE > 3 ? 3 : BASE;
};

// Two fp32 values rounded to nearest-even T and packed, lo in the low half.
template <class T> __device__ __forceinline__ unsigned pack_rn(float lo, float hi);

template <> __device__ __forceinline__ unsigned pack_rn<gqakv_bf16>(float lo, float hi) {
#ifdef GQAKV_EMULATION
    return (unsigned)from_float<gqakv_bf16>(lo).bits | ((unsigned)from_float<gqakv_bf16>(hi).bits << 16);
#else
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // first source: high half
    return r;
#endif
}

template <> __device__ __forceinline__ unsigned pack_rn<gqakv_half>(float lo, float hi) {
#ifdef GQAKV_EMULATION
    return (unsigned)from_float<gqakv_half>(lo).bits | ((unsigned)from_float<gqakv_half>(hi).bits << 16);
#else
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

// The low / high 16-bit element of a packed pair, as fp32.
template <class T> __device__ __forceinline__ float half_of(unsigned w, int hi) {
    T x;
    x.bits = (unsigned short)(hi ? w >> 16 : w & 0xffffu);
    return to_float(x);
}

// (x.lo, y.lo) or (x.hi, y.hi) as one pair: two keys' values of one d for a B fragment.
__device__ __forceinline__ unsigned pair_of(unsigned x, unsigned y, int hi) {
    return hi ? (x >> 16) | (y & 0xffff0000u) : (x & 0xffffu) | (y << 16);
}

// T: the storage type (q and K/V enter the mma together, so KernelTypes' Q and KV are the
// same here); VARIANT: the variant trait's flags (variant.cuh; 0 is plain causal).
template <class T, int D, int VARIANT = 0, class... Pages>
__global__ void __launch_bounds__(128, (DecodeMmaCtas<T, D, VARIANT>::value)) gqakv_decode_mma(
    const typename KernelTypes<T>::Q* __restrict__ q, const typename KernelTypes<T>::KV* __restrict__ k_buf,
    const typename KernelTypes<T>::KV* __restrict__ v_buf,
    const i64* __restrict__ rows, const i64* __restrict__ lens, const i64* __restrict__ n_new,
    typename KernelTypes<T>::Out* __restrict__ out, float* __restrict__ lse,
    float* __restrict__ part_o, float* __restrict__ part_lse,
    int Hkv, int G, int Tq, int n_qchunks, int num_splits, i64 keys_per_split, AttnParams params,
    i64 q_sb, i64 q_sh, i64 q_st, i64 buf_sb, i64 buf_sh, i64 buf_st,
    i64 o_sb, i64 o_sh, i64 o_st, Pages... pages) {
    typedef KernelTypes<T> Ty;
    typedef typename Ty::KV KV;
    typedef DecodeMmaShape<KV, D> S;
    typedef Variant<VARIANT> V;
    const DecodeCta cta = decode_cta<V>(lens, n_new, Hkv, n_qchunks, keys_per_split, params);
    const int qc = cta.qc, kvh = cta.kvh, b = cta.b, split = cta.split;
    const i64 L = cta.L, n = cta.n, k_begin = cta.k_begin, k_end = cta.k_end;
    if (n == 0) return;  // uniform over the CTA
    if (k_begin >= k_end) {  // uniform too: a split past this entry's keys
        write_empty_split(b, kvh, qc, S::QB, Hkv, G, Tq, n, num_splits, split, part_lse);
        return;
    }
    const int n_keys = (int)(k_end - k_begin);  // < 2^30 (the planner splits longer rows)
    const int n_blocks = (n_keys + S::KEYS - 1) / S::KEYS;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int fr = lane / 4, fc = lane % 4;  // fragment row group and column pair

    // Start this warp's first K/V step before anything else. kw[t]: key 16 blk + 8 t + fr,
    // chunks at d = 32 i + 8 fc; vw[j]: key 16 blk + 2 fc + (j & 1) + 8 (j >> 1), chunks at
    // d = 64 i + 8 fr.
    const auto kv = kv_reader<Ty>(k_buf, v_buf, rows[b], kvh, buf_sb, buf_sh, buf_st, params, D, pages...);
    Words<S::KW> kw[2];
    Words<S::VW> vw[4];
#pragma unroll
    for (int i = 0; i < S::KW; ++i) kw[0].w[i] = kw[1].w[i] = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int i = 0; i < S::VW; ++i) vw[j].w[i] = 0u;
    }
    // Keys past the split's end are never loaded (their registers keep older, finite
    // values whose scores are masked to -inf, so their weights are exactly 0). Each load
    // asks the K/V reader for one key's row (per key block, no running pointers).
    auto fetch_k = [&](int blk) {
        const int key = blk * S::KEYS + fr;
        if (key < n_keys) load_chunks(kw[0], kv.k_row(k_begin + key) + fc * 8, 32);
        if (key + 8 < n_keys) load_chunks(kw[1], kv.k_row(k_begin + key + 8) + fc * 8, 32);
    };
    auto fetch_v = [&](int blk) {
        const int key = blk * S::KEYS + 2 * fc;
        if (key < n_keys) load_chunks(vw[0], kv.v_row(k_begin + key) + fr * 8, 64);
        if (key + 1 < n_keys) load_chunks(vw[1], kv.v_row(k_begin + key + 1) + fr * 8, 64);
        if (key + 8 < n_keys) load_chunks(vw[2], kv.v_row(k_begin + key + 8) + fr * 8, 64);
        if (key + 9 < n_keys) load_chunks(vw[3], kv.v_row(k_begin + key + 9) + fr * 8, 64);
    };
    if (warp < n_blocks) {
        fetch_k(warp);
        fetch_v(warp);
    }

    // Keys (from k_begin) each query row sees: lo <= j < lim with lim = min(n_keys,
    // key_hi - k_begin) (0 for a padding row) and lo = max(0, key_lo - k_begin) (0 without
    // a window). Blocks inside [lo_all, lim_all) need no mask.
    auto row_limit = [&](int r, bool& valid, int& g, int& t, int& lo, int& qrel) {
        const int qi = qc * S::QB + r;
        g = qi / Tq;
        t = qi % Tq;
        valid = qi < G * Tq && t < n;
        const i64 pos = L - n + t;
        qrel = (int)(pos - k_begin);  // the query's position from k_begin (ALiBi's offsets)
        const i64 first = V::key_lo(params, pos) - k_begin;
        lo = !V::WINDOW || first <= 0 ? 0 : (first < n_keys ? (int)first : n_keys);
        const i64 seen = V::key_hi(pos) - k_begin;
        return !valid || seen <= 0 ? 0 : (seen < n_keys ? (int)seen : n_keys);
    };
    int lim_all = n_keys, lo_all = 0;
#pragma unroll 1
    for (int r = 0; r < S::QB; ++r) {
        bool valid;
        int g, t, lo_r, qrel_r;
        const int lr = row_limit(r, valid, g, t, lo_r, qrel_r);
        if (valid && lr < lim_all) lim_all = lr;
        if (valid && lo_r > lo_all) lo_all = lo_r;
    }

    // ALiBi: each query row's slope (log2 domain; 0 for padding) and position from k_begin,
    // in shared memory (fewer registers live in the key loop; see DecodeMmaCtas).
    __shared__ float sm_slope[V::ALIBI ? S::QB : 1];
    __shared__ float sm_qrel[V::ALIBI ? S::QB : 1];
    if (V::ALIBI) {
        for (int r = (int)threadIdx.x; r < S::QB; r += (int)blockDim.x) {
            bool valid;
            int g, t, lo_r, qrel_r;
            row_limit(r, valid, g, t, lo_r, qrel_r);
            sm_slope[r] = valid ? V::alibi_log2(params, kvh * G + g) : 0.f;
            sm_qrel[r] = (float)qrel_r;
        }
        __syncthreads();  // every thread is here: the early returns above are CTA-uniform
    }

    // Q rows fr and fr + 8 as A fragments (zeros for padding rows), unscaled: the scores
    // are scaled in fp32 after the mma.
    unsigned qa[S::KK][4];
    int lim[2], lo[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        bool valid;
        int g, t, qrel_unused;
        lim[h] = row_limit(fr + 8 * h, valid, g, t, lo[h], qrel_unused);
        Words<S::KW> qw;
#pragma unroll
        for (int i = 0; i < S::KW; ++i) qw.w[i] = 0u;
        if (valid)
            load_chunks(qw, q + (i64)b * q_sb + (i64)(kvh * G + g) * q_sh + (i64)t * q_st + fc * 8, 32);
#pragma unroll
        for (int kk = 0; kk < S::KK; ++kk) {
            qa[kk][h] = qw.w[2 * kk];          // cols 2c, 2c + 1 of k-step kk
            qa[kk][2 + h] = qw.w[2 * kk + 1];  // cols 2c + 8, 2c + 9
        }
    }

    const float qscale = V::fold(params);  // then V::transform_at: the log2 domain
    float o[S::NB][4];  // O rows fr (0, 1) and fr + 8 (2, 3), columns 2 fc, 2 fc + 1
    SoftmaxState<true> st[2];
    st[0].init();
    st[1].init();
#pragma unroll
    for (int nb = 0; nb < S::NB; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.f;

    for (int blk = warp; blk < n_blocks; blk += S::WARPS) {
        // Scores: s[t][0..1] row fr, s[t][2..3] row fr + 8; keys 16 blk + 8 t + 2 fc + (0, 1).
        float s[2][4];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < S::KK; ++kk) {
                const unsigned bk[2] = {kw[t].w[2 * kk], kw[t].w[2 * kk + 1]};
                mma_m16n8k16<T>(s[t], qa[kk], bk);
            }
        }
        if (blk + S::WARPS < n_blocks) fetch_k(blk + S::WARPS);  // K registers are free again

        const int kb = blk * S::KEYS;
        const bool masked = kb + S::KEYS > lim_all || kb < lo_all;  // uniform over the warp
#pragma unroll
        for (int t = 0; t < 2; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = kb + 8 * t + 2 * fc + (e & 1);
                const int r = fr + 8 * (e >> 1);
                s[t][e] = V::transform_at(params, s[t][e] * qscale, V::ALIBI ? sm_slope[r] : 0.f,
                                          V::ALIBI ? (float)j - sm_qrel[r] : 0.f);
                if (masked && (j >= lim[e >> 1] || j < lo[e >> 1])) s[t][e] = GQAKV_NEG_INF;
            }
        }
        float p[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(GQAKV_FULL_MASK, mx, 1));  // the row's 4 lanes
            mx = fmaxf(mx, __shfl_xor_sync(GQAKV_FULL_MASK, mx, 2));
            if (mx > st[h].m) {  // the running max grows: rescale (rare after the first keys)
                const float corr = st[h].raise(mx);  // 0 while the row is empty
#pragma unroll
                for (int nb = 0; nb < S::NB; ++nb) {
                    o[nb][2 * h] *= corr;
                    o[nb][2 * h + 1] *= corr;
                }
            }
            // No key yet: every p is exp2(-inf) = 0. A NaN score (skipped by the max) gives
            // p = NaN, so l turns NaN and write_decode_rows writes NaN out and lse.
            const float mu = st[h].base();
#pragma unroll
            for (int t = 0; t < 2; ++t) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    p[t][2 * h + e] = st[h].weight(s[t][2 * h + e], mu);
                    st[h].l += p[t][2 * h + e];
                }
            }
        }
        // P as A fragments, hi and lo parts: register r holds tile r >> 1, row half r & 1.
        unsigned ph[4], pl[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const float x = p[r >> 1][2 * (r & 1)], y = p[r >> 1][2 * (r & 1) + 1];
            ph[r] = pack_rn<T>(x, y);
            pl[r] = pack_rn<T>(x - half_of<T>(ph[r], 0), y - half_of<T>(ph[r], 1));
        }
#pragma unroll
        for (int nb = 0; nb < S::NB; ++nb) {
            const unsigned bv[2] = {pair_of(vw[0].w[nb / 2], vw[1].w[nb / 2], nb % 2),   // keys 2c, 2c + 1
                                    pair_of(vw[2].w[nb / 2], vw[3].w[nb / 2], nb % 2)};  // 2c + 8, 2c + 9
            mma_m16n8k16<T>(o[nb], ph, bv);
            mma_m16n8k16<T>(o[nb], pl, bv);
        }
        if (blk + S::WARPS < n_blocks) fetch_v(blk + S::WARPS);
    }

    // Row sums over the row's 4 lanes, then the 4 warps' states merged per row.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        st[h].l += __shfl_xor_sync(GQAKV_FULL_MASK, st[h].l, 1);
        st[h].l += __shfl_xor_sync(GQAKV_FULL_MASK, st[h].l, 2);
    }
    __shared__ float sm_m[S::WARPS][S::QB];
    __shared__ float sm_l[S::WARPS][S::QB];
    __shared__ float sm_o[S::WARPS][S::QB][D];
    if (fc == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            sm_m[warp][fr + 8 * h] = st[h].m;
            sm_l[warp][fr + 8 * h] = st[h].l;
        }
    }
#pragma unroll
    for (int nb = 0; nb < S::NB; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            sm_o[warp][fr + 8 * (e >> 1)][64 * (nb / 8) + 8 * (2 * fc + (e & 1)) + nb % 8] = o[nb][e];
    }
    __syncthreads();

    write_decode_rows<V, typename Ty::Out, D, S::QB, S::WARPS>(sm_m, sm_l, sm_o, b, kvh, qc, Hkv, G, Tq, n,
                                                              num_splits, split, params, out, lse,
                                                              part_o, part_lse, o_sb, o_sh, o_st);
}
