// Decode attention (T = 1 and small T): one CTA per (entry b, KV head, query chunk, split).
//
// The G query heads of a KV head and the T query tokens are folded into one query tile of
// QB queries (query qi = g * T + t), so each live K/V row is read from HBM once per KV head
// and query chunk, not once per query head. QB is a template parameter (4 or 8, see
// sources.DECODE_QUERY_TILES): the planner picks the smallest tile holding G * T queries,
// so Llama-style G = 4, T = 1 does not pay registers for 8 queries; larger G * T take
// several query chunks of the largest tile. Lanes split a key row into 16-byte vectors; the
// lanes of one key reduce its dot products with full-mask xor shuffles; each lane group
// keeps an online-softmax state per query, merged through shared memory at the end.
//
// Keys: split s covers [s * keys_per_split, min(L, (s + 1) * keys_per_split)); nothing at
// or past L = lens[b] is ever read. Query t sits at position L - n + t and sees keys 0..it.
// With num_splits == 1 the CTA writes out (in T) and lse directly; otherwise it writes
// fp32 partials (normalized output and natural-log LSE) for gqakv_merge.
//
// Launch: grid (B * Hkv * n_qchunks, num_splits), block 128 (4 warps).
#include "common.cuh"

template <class T, int D, int QB_>
struct DecodeShape {
    static constexpr int WARPS = 4;
    static constexpr int QB = QB_;                                // queries per CTA
    static constexpr int VEC = VecWidth<T, D>::value;             // elements per load
    static constexpr int NCH = D / VEC;                           // vectors per key row
    static constexpr int LPK = gqakv_cmin(32, gqakv_pow2_ceil(NCH));  // lanes per key
    static constexpr int CPL = (NCH + LPK - 1) / LPK;             // vectors per lane
    static constexpr int EPL = CPL * VEC;                         // elements per lane
    static constexpr int KPW = 32 / LPK;                          // keys per warp per step
    static constexpr int NG = WARPS * KPW;                        // keys per CTA per step
};

// Tile 4 asks ptxas for 4 resident CTAs per SM (<= 128 registers a thread, which it
// meets without spills); tile 8 needs ~205 and is left to the compiler (2 CTAs per SM).
template <class T, int D, int QB>
__global__ void __launch_bounds__(128, QB <= 4 ? 4 : 1) gqakv_decode(
    const T* __restrict__ q, const T* __restrict__ k_buf, const T* __restrict__ v_buf,
    const i64* __restrict__ rows, const i64* __restrict__ lens, const i64* __restrict__ n_new,
    T* __restrict__ out, float* __restrict__ lse,
    float* __restrict__ part_o, float* __restrict__ part_lse,
    int Hkv, int G, int Tq, int n_qchunks, int num_splits, i64 keys_per_split, float scale,
    i64 q_sb, i64 q_sh, i64 q_st, i64 buf_sb, i64 buf_sh, i64 buf_st,
    i64 o_sb, i64 o_sh, i64 o_st) {
    typedef DecodeShape<T, D, QB> S;
    const int qc = blockIdx.x % n_qchunks;
    const int kvh = (blockIdx.x / n_qchunks) % Hkv;
    const int b = blockIdx.x / (n_qchunks * Hkv);
    const int split = blockIdx.y;
    const i64 L = lens[b];
    const i64 n = n_new[b];
    const i64 k_begin = (i64)split * keys_per_split;
    const i64 k_end = L < k_begin + keys_per_split ? L : k_begin + keys_per_split;
    if (n == 0 || k_begin >= k_end) return;  // uniform over the CTA

    const int lane = threadIdx.x % 32;
    const int grp = (threadIdx.x / 32) * S::KPW + lane / S::LPK;  // key slot of this lane
    const int sub = lane % S::LPK;                                // position within the key row

    // Queries of this tile, scaled, in registers: this lane's vectors of each query.
    float qr[S::QB][S::EPL];
    i64 pos[S::QB];     // absolute position of each query (-1: not a real query)
#pragma unroll
    for (int i = 0; i < S::QB; ++i) {
        const int qi = qc * S::QB + i;
        const int g = qi / Tq, t = qi % Tq;
        const bool valid = qi < G * Tq && t < n;
        pos[i] = valid ? L - n + t : -1;
        const i64 q_off = (i64)b * q_sb + (i64)(kvh * G + g) * q_sh + (i64)t * q_st;
#pragma unroll
        for (int c = 0; c < S::CPL; ++c) {
            const int ch = sub + c * S::LPK;
            if (valid && ch < S::NCH) {
                load_vec<T, S::VEC>(q + q_off + ch * S::VEC, &qr[i][c * S::VEC]);
#pragma unroll
                for (int e = 0; e < S::VEC; ++e) qr[i][c * S::VEC + e] *= scale;
            } else {
#pragma unroll
                for (int e = 0; e < S::VEC; ++e) qr[i][c * S::VEC + e] = 0.f;
            }
        }
    }

    // Online-softmax state per query (empty: m = -inf, l = 0, acc = 0).
    float m[S::QB], l[S::QB], acc[S::QB][S::EPL];
#pragma unroll
    for (int i = 0; i < S::QB; ++i) {
        m[i] = GQAKV_NEG_INF;
        l[i] = 0.f;
#pragma unroll
        for (int e = 0; e < S::EPL; ++e) acc[i][e] = 0.f;
    }

    const i64 head_off = rows[b] * buf_sb + (i64)kvh * buf_sh;
    // Every lane runs the same number of steps (the shuffles need the whole warp).
    for (i64 j0 = k_begin; j0 < k_end; j0 += S::NG) {
        const i64 j = j0 + grp;
        const bool live = j < k_end;
        float kr[S::EPL], vr[S::EPL];
#pragma unroll
        for (int c = 0; c < S::CPL; ++c) {
            const int ch = sub + c * S::LPK;
            if (live && ch < S::NCH) {
                load_vec<T, S::VEC>(k_buf + head_off + j * buf_st + ch * S::VEC, &kr[c * S::VEC]);
                load_vec<T, S::VEC>(v_buf + head_off + j * buf_st + ch * S::VEC, &vr[c * S::VEC]);
            } else {
#pragma unroll
                for (int e = 0; e < S::VEC; ++e) kr[c * S::VEC + e] = vr[c * S::VEC + e] = 0.f;
            }
        }
#pragma unroll
        for (int i = 0; i < S::QB; ++i) {
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < S::EPL; ++e) s += qr[i][e] * kr[e];
            s = group_sum<S::LPK>(s);
            if (live && j <= pos[i]) {
                const float m_new = fmaxf(m[i], s);
                const float corr = expf(m[i] - m_new);  // 0 while the state is empty
                const float p = expf(s - m_new);
                l[i] = l[i] * corr + p;
#pragma unroll
                for (int e = 0; e < S::EPL; ++e) acc[i][e] = acc[i][e] * corr + p * vr[e];
                m[i] = m_new;
            }
        }
    }

    // Merge the NG key slots' states per query.
    __shared__ float sm_m[S::NG][S::QB];
    __shared__ float sm_l[S::NG][S::QB];
    __shared__ float sm_acc[S::NG][S::QB][D];
#pragma unroll
    for (int i = 0; i < S::QB; ++i) {
        if (sub == 0) {
            sm_m[grp][i] = m[i];
            sm_l[grp][i] = l[i];
        }
#pragma unroll
        for (int c = 0; c < S::CPL; ++c) {
            const int ch = sub + c * S::LPK;
            if (ch < S::NCH) {
#pragma unroll
                for (int e = 0; e < S::VEC; ++e) sm_acc[grp][i][ch * S::VEC + e] = acc[i][c * S::VEC + e];
            }
        }
    }
    __syncthreads();

    const int Hq = Hkv * G;
    for (int idx = threadIdx.x; idx < S::QB * D; idx += blockDim.x) {
        const int i = idx / D, d = idx % D;
        const int qi = qc * S::QB + i;
        const int g = qi / Tq, t = qi % Tq;
        if (qi >= G * Tq || t >= n) continue;  // padding: out stays 0, lse -inf
        const int h = kvh * G + g;
        float mx = GQAKV_NEG_INF;
        for (int s = 0; s < S::NG; ++s) mx = fmaxf(mx, sm_m[s][i]);
        float total = 0.f, o = 0.f;
        if (mx != GQAKV_NEG_INF) {
            for (int s = 0; s < S::NG; ++s) {
                const float w = expf(sm_m[s][i] - mx);  // 0 for empty slots
                total += w * sm_l[s][i];
                o += w * sm_acc[s][i][d];
            }
        }
        const float o_val = total > 0.f ? o / total : 0.f;
        const float lse_val = total > 0.f ? mx + logf(total) : GQAKV_NEG_INF;
        const i64 qidx = ((i64)b * Hq + h) * Tq + t;
        if (num_splits == 1) {
            out[(i64)b * o_sb + (i64)h * o_sh + (i64)t * o_st + d] = from_float<T>(o_val);
            if (d == 0) lse[qidx] = lse_val;
        } else {
            part_o[(qidx * num_splits + split) * D + d] = o_val;
            if (d == 0) part_lse[qidx * num_splits + split] = lse_val;
        }
    }
}
