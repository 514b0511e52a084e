// Helpers shared by the decode kernels (decode.cu: fp32 FMA; decode_mma.cu: tensor cores).
#pragma once
#include "variant.cuh"

// The work of one decode CTA in the grid (B * Hkv * n_qchunks, num_splits) that
// plan.plan_attention launches: entry b, KV head kvh, query chunk qc, split, the entry's
// length L and new tokens n, and the split's keys [k_begin, k_end) (empty past L). Splits
// start at the first key any query of the entry sees (the variant's key_lo of its first
// query: 0 for causal, the window's start otherwise), so work and bytes follow the window.
struct DecodeCta {
    int qc, kvh, b, split;
    i64 L, n, k_begin, k_end;
};

template <class V>
__device__ __forceinline__ DecodeCta decode_cta(const i64* __restrict__ lens,
                                                const i64* __restrict__ n_new, int Hkv,
                                                int n_qchunks, i64 keys_per_split,
                                                const AttnParams& params) {
    DecodeCta w;
    w.qc = blockIdx.x % n_qchunks;
    w.kvh = (blockIdx.x / n_qchunks) % Hkv;
    w.b = blockIdx.x / (n_qchunks * Hkv);
    w.split = blockIdx.y;
    w.L = lens[w.b];
    w.n = n_new[w.b];
    w.k_begin = V::key_lo(params, w.L - w.n) + (i64)w.split * keys_per_split;
    w.k_end = w.L < w.k_begin + keys_per_split ? w.L : w.k_begin + keys_per_split;
    return w;
}

// A split that holds no key of its entry (the planner sizes splits for the longest span
// of the batch): its partials say so (lse -inf, never read by gqakv_merge), so the merge
// takes the planner's split layout as it is and needs no per-row split count.
__device__ __forceinline__ void write_empty_split(int b, int kvh, int qc, int QB, int Hkv, int G,
                                                  int Tq, i64 n, int num_splits, int split,
                                                  float* __restrict__ part_lse) {
    if (num_splits == 1) return;  // out and lse keep the caller's 0 / -inf
    for (int i = threadIdx.x; i < QB; i += blockDim.x) {
        const int qi = qc * QB + i;
        const int g = qi / Tq, t = qi % Tq;
        if (qi >= G * Tq || t >= n) continue;
        const i64 qidx = ((i64)b * Hkv * G + kvh * G + g) * Tq + t;
        part_lse[qidx * num_splits + split] = GQAKV_NEG_INF;
    }
}

// NW 32-bit words loaded with the widest aligned vector accesses (16 bytes when NW is a
// multiple of 4): raw 16-bit pairs kept in registers until used.
template <int NW>
struct alignas(NW % 4 == 0 ? 16 : (NW % 2 == 0 ? 8 : 4)) Words {
    unsigned w[NW];
};

template <int NW>
__device__ __forceinline__ void load_words(Words<NW>& dst, const void* __restrict__ p) {
    dst = *reinterpret_cast<const Words<NW>*>(p);
}

// NW words (a multiple of 4) from NW / 4 16-byte chunks, chunk i at p + i * stride elements.
template <int NW, class T>
__device__ __forceinline__ void load_chunks(Words<NW>& dst, const T* __restrict__ p, int stride) {
    static_assert(NW % 4 == 0, "load_chunks: whole 16-byte chunks");
#pragma unroll
    for (int i = 0; i < NW / 4; ++i) {
        Words<4> c;
        load_words(c, p + i * stride);
#pragma unroll
        for (int k = 0; k < 4; ++k) dst.w[4 * i + k] = c.w[k];
    }
}

// The end of a decode CTA: the NS online-softmax states of each of its QB query rows (in
// shared memory, after a __syncthreads) merged into one, then written as the output row
// and its natural-log LSE (num_splits == 1) or as this split's fp32 partials for
// gqakv_merge. States are in the log2 domain (m: running max of log2-scaled scores).
// Padded rows (query index >= G * Tq or token >= n) are skipped: out stays 0, lse -inf.
// A NaN score never raises m (the max skips it) but makes that state's l NaN for good
// (its weight is exp2(NaN) = NaN, and NaN * 0 is NaN at every later rescale), so a query
// whose scores include NaN is recognised here, once per CTA, and written as NaN out and
// lse: the key loops pay nothing for it.
template <class V, class TO, int D, int QB, int NS>
__device__ __forceinline__ void write_decode_rows(
    const float (&sm_m)[NS][QB], const float (&sm_l)[NS][QB], const float (&sm_acc)[NS][QB][D],
    int b, int kvh, int qc, int Hkv, int G, int Tq, i64 n, int num_splits, int split,
    const AttnParams& params, TO* __restrict__ out, float* __restrict__ lse,
    float* __restrict__ part_o, float* __restrict__ part_lse, i64 o_sb, i64 o_sh, i64 o_st) {
    const int Hq = Hkv * G;
    for (int idx = threadIdx.x; idx < QB * D; idx += blockDim.x) {
        const int i = idx / D, d = idx % D;
        const int qi = qc * QB + i;
        const int g = qi / Tq, t = qi % Tq;
        if (qi >= G * Tq || t >= n) continue;  // padding: out stays 0, lse -inf
        const int h = kvh * G + g;
        float mx = GQAKV_NEG_INF;
        for (int s = 0; s < NS; ++s) mx = fmaxf(mx, sm_m[s][i]);
        float total = 0.f, o = 0.f;
        if (mx != GQAKV_NEG_INF) {
            for (int s = 0; s < NS; ++s) {
                // w is 0 for states that saw no finite score; w * NaN is still NaN.
                const float w = merge_weight_log2(sm_m[s][i], mx);
                total += w * sm_l[s][i];
                o += w * sm_acc[s][i][d];
            }
        } else {
            // No state saw a finite score: each l is 0 (no key) or NaN (only NaN scores).
            for (int s = 0; s < NS; ++s) total += sm_l[s][i];
        }
        // The sink term joins once, after every key of the query is summed: here when the
        // CTA saw all of them, in gqakv_merge when split.
        if (V::SINKS && num_splits == 1) o *= add_sink_log2(mx, total, V::sink_log2(params, h));
        // total > 0: keys seen; 0: none (out 0, lse -inf); NaN: a NaN score (out and lse
        // NaN, never hidden: o / NaN and log2f(NaN) are NaN).
        const float o_val = total != 0.f ? o / total : 0.f;
        const float lse_val = finished_lse(mx, total);
        const i64 qidx = ((i64)b * Hq + h) * Tq + t;
        if (num_splits == 1) {
            out[(i64)b * o_sb + (i64)h * o_sh + (i64)t * o_st + d] = from_float<TO>(o_val);
            if (d == 0) lse[qidx] = lse_val;
        } else {
            part_o[(qidx * num_splits + split) * D + d] = o_val;
            if (d == 0) part_lse[qidx * num_splits + split] = lse_val;
        }
    }
}
