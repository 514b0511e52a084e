// Split-KV merge: combine the fp32 partials of the decode kernels' splits per query.
//
// Split s of query (b, h, t) holds o_s (its normalized output) and lse_s (natural-log
// LSE of its scaled scores, -inf when it saw no key). The result is
//   out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M),  lse = M + log(sum_s exp(lse_s - M))
// with M = max_s lse_s (weights and the sink term through softmax.cuh). Every split of the
// planner's layout is read: a split that held no key of row b wrote lse -inf
// (write_empty_split), so no split count is derived here. Padded queries (t >= n_new[b])
// are skipped: out stays 0, lse -inf. Under the sinks variant the sink logit of head h
// joins once, here, after all splits (a query that saw no key keeps 0 / -inf).
//
// Non-finite partials follow gqakv.merge_attention: a split with lse -inf saw no key and
// is skipped (its o_s is never read); a NaN or +inf lse_s makes the query's out and lse
// NaN; a NaN in o_s of a split that saw keys makes that element of out NaN (it is
// multiplied in even when its weight underflows to 0). Nothing is ever turned into 0.
//
// Cheap by design: a CTA per query reads S x D x 4 bytes of partials it can fetch at once,
// so its time is a few memory round trips. The 128 threads split into NGRP groups of
// D / VEC threads (VEC = 4 fp32, one 16-byte load, where D allows); group j sums splits
// j, j + NGRP, ... (unrolled, so several loads are in flight per thread), and the groups'
// sums meet in shared memory. Every thread derives M and the weights from the LSEs itself
// (broadcast loads).
//
// Launch: grid (B * Hq * Tq), block 128. part_o is [B, Hq, Tq, num_splits, D],
// part_lse [B, Hq, Tq, num_splits], lse [B, Hq, Tq] (all contiguous fp32).
#include "variant.cuh"

template <int D>
struct MergeShape {
    static constexpr int VEC = D % 4 == 0 ? 4 : 1;           // fp32 per load
    static constexpr int LANES = D / VEC;                    // threads per split group
    static constexpr int NGRP = LANES >= 128 ? 1 : 128 / LANES;  // split groups
    static constexpr int PER = (LANES + 127) / 128;          // vectors per thread (D > 512 / VEC)
};

// VARIANT: the variant trait's flags (variant.cuh); only the sink term matters here.
template <class T, int D, int VARIANT = 0>
__global__ void __launch_bounds__(128) gqakv_merge(
    const float* __restrict__ part_o, const float* __restrict__ part_lse,
    const i64* __restrict__ n_new, typename KernelTypes<T>::Out* __restrict__ out,
    float* __restrict__ lse, int Hq, int Tq, int num_splits, AttnParams params,
    i64 o_sb, i64 o_sh, i64 o_st) {
    typedef MergeShape<D> S;
    typedef Variant<VARIANT> V;
    const i64 qidx = blockIdx.x;
    const int t = (int)(qidx % Tq);
    const int h = (int)((qidx / Tq) % Hq);
    const int b = (int)(qidx / ((i64)Tq * Hq));
    if (t >= n_new[b]) return;  // uniform over the CTA
    const int splits = num_splits;
    const float* lse_s = part_lse + qidx * num_splits;
    float mx = GQAKV_NEG_INF;
    bool bad = false;  // a NaN or +inf lse_s (fmaxf alone would skip a NaN)
    for (int s = 0; s < splits; ++s) {
        const float x = lse_s[s];
        bad |= !(x < -GQAKV_NEG_INF);
        mx = fmaxf(mx, x);
    }
    const float qnan = __int_as_float(0x7fc00000);
    float total = 0.f;  // > 0 (at least 1, the largest split's weight) once any split saw keys
    if (bad) {
        total = qnan;
    } else if (mx != GQAKV_NEG_INF) {
        for (int s = 0; s < splits; ++s) total += merge_weight_lse(lse_s[s], mx);
    }
    const bool seen = bad || mx != GQAKV_NEG_INF;  // else: no split saw a key, out 0, lse -inf
    // The sink term, relative to mx (m_rel = 0: weights are 2^((lse_s - mx) log2 e)); its
    // factor `corr` scales the summed outputs. Nothing changes without it or without keys.
    float m_rel = 0.f, corr = 1.f;
    if (V::SINKS) {
        const float sink = seen && !bad ? (params.sinks[h] - mx) * GQAKV_LOG2E : GQAKV_NEG_INF;
        corr = add_sink_log2(m_rel, total, sink);  // -inf: nothing changes
    }

    // This thread's split group and vector slots (slot v covers d = VEC * (lane + 128 v)).
    const int grp = S::NGRP > 1 ? threadIdx.x / S::LANES : 0;
    const int lane = S::NGRP > 1 ? threadIdx.x % S::LANES : threadIdx.x;
    float acc[S::PER][S::VEC];
#pragma unroll
    for (int v = 0; v < S::PER; ++v) {
#pragma unroll
        for (int e = 0; e < S::VEC; ++e) acc[v][e] = 0.f;
    }
    if (seen && !bad && grp < S::NGRP) {
        const float* po = part_o + qidx * num_splits * (i64)D;
#pragma unroll 4
        for (int s = grp; s < splits; s += S::NGRP) {
            if (lse_s[s] == GQAKV_NEG_INF) continue;  // saw no key: its o_s may be anything
            const float w = merge_weight_lse(lse_s[s], mx);
#pragma unroll
            for (int v = 0; v < S::PER; ++v) {
                const int c = lane + 128 * v;
                if (c < S::LANES) {
                    float x[S::VEC];
                    load_vec<float, S::VEC>(po + (i64)s * D + c * S::VEC, x);
#pragma unroll
                    for (int e = 0; e < S::VEC; ++e) acc[v][e] += w * x[e];
                }
            }
        }
    }
    __shared__ float sm_acc[S::NGRP > 1 ? S::NGRP : 1][S::NGRP > 1 ? D : 1];
    if (S::NGRP > 1) {
        if (grp < S::NGRP) {
#pragma unroll
            for (int e = 0; e < S::VEC; ++e) sm_acc[grp][lane * S::VEC + e] = acc[0][e];
        }
        __syncthreads();
    }
    typename KernelTypes<T>::Out* o_row = out + (i64)b * o_sb + (i64)h * o_sh + (i64)t * o_st;
    if (S::NGRP > 1) {
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float o = 0.f;
            for (int g = 0; g < S::NGRP; ++g) o += sm_acc[g][d];
            o_row[d] = from_float<typename KernelTypes<T>::Out>(seen ? o * corr / total : 0.f);
        }
    } else {
#pragma unroll
        for (int v = 0; v < S::PER; ++v) {
            const int c = lane + 128 * v;
            if (c < S::LANES) {
#pragma unroll
                for (int e = 0; e < S::VEC; ++e)
                    o_row[c * S::VEC + e] = from_float<typename KernelTypes<T>::Out>(seen ? acc[v][e] * corr / total : 0.f);
            }
        }
    }
    if (threadIdx.x == 0) lse[qidx] = bad ? qnan : seen ? mx + finished_lse(m_rel, total) : GQAKV_NEG_INF;
}
