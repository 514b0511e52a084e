// Split-KV merge: combine the fp32 partials of gqakv_decode's splits per query.
//
// Split s of query (b, h, t) holds o_s (its normalized output) and lse_s (natural-log
// LSE of its scaled scores, -inf when it saw no key). The result is
//   out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M),  lse = M + log(sum_s exp(lse_s - M))
// with M = max_s lse_s. Only the splits that hold keys of row b, ceil(L / keys_per_split)
// of them, are read. Padded queries (t >= n_new[b]) are skipped: out stays 0, lse -inf.
//
// Launch: grid (B * Hq * Tq), block 128. part_o is [B, Hq, Tq, num_splits, D],
// part_lse [B, Hq, Tq, num_splits], lse [B, Hq, Tq] (all contiguous fp32).
#include "common.cuh"

template <class T, int D>
__global__ void __launch_bounds__(128) gqakv_merge(
    const float* __restrict__ part_o, const float* __restrict__ part_lse,
    const i64* __restrict__ lens, const i64* __restrict__ n_new,
    T* __restrict__ out, float* __restrict__ lse,
    int Hq, int Tq, int num_splits, i64 keys_per_split,
    i64 o_sb, i64 o_sh, i64 o_st) {
    const i64 qidx = blockIdx.x;
    const int t = (int)(qidx % Tq);
    const int h = (int)((qidx / Tq) % Hq);
    const int b = (int)(qidx / ((i64)Tq * Hq));
    if (t >= n_new[b]) return;
    const i64 L = lens[b];
    i64 splits = (L + keys_per_split - 1) / keys_per_split;
    if (splits > num_splits) splits = num_splits;
    const float* lse_s = part_lse + qidx * num_splits;
    float mx = GQAKV_NEG_INF;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, lse_s[s]);
    float total = 0.f;
    if (mx != GQAKV_NEG_INF) {
        for (int s = 0; s < splits; ++s) total += expf(lse_s[s] - mx);
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.f;
        if (total > 0.f) {
            for (int s = 0; s < splits; ++s)
                o += expf(lse_s[s] - mx) * part_o[(qidx * num_splits + s) * D + d];
            o /= total;
        }
        out[(i64)b * o_sb + (i64)h * o_sh + (i64)t * o_st + d] = from_float<T>(o);
    }
    if (threadIdx.x == 0) lse[qidx] = total > 0.f ? mx + logf(total) : GQAKV_NEG_INF;
}
