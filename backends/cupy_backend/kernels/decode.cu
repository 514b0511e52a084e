// Decode attention (T = 1 and small T): one CTA per (entry b, KV head, query chunk, split).
// This fp32-FMA kernel serves float32 and the head dims the tensor-core decode
// (decode_mma.cu: float16 / bfloat16 at d = 64 and 128) does not take.
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
// Keys: split s covers [lo + s * keys_per_split, min(L, lo + (s + 1) * keys_per_split)),
// lo the first key the entry's first query sees (0, or the sliding window's start);
// nothing at or past L = lens[b] is ever read. Query t sits at position p = L - n + t and
// sees the keys the variant trait allows (variant.cuh: 0..p, or p - W + 1..p).
// With num_splits == 1 the CTA writes out (in T) and lse directly; otherwise it writes
// fp32 partials (normalized output and natural-log LSE) for gqakv_merge.
//
// Bandwidth (why the key loop is software-pipelined). Decode streams K and V once and
// does little math per byte, so HBM bandwidth is reached only with enough bytes in flight:
// by Little's law an H200 (4.8 TB/s, ~0.6-1 us loaded latency) needs ~3-5 MB in flight,
// ~25-40 KB per SM on 132 SMs. A lane's key step is one 16-byte K and one 16-byte V vector
// per CPL (32 B for 16-bit d = 128). Loading a step and consuming it at once leaves 32 B per
// lane outstanding: 128 threads x 32 B x 4 CTAs = 16 KB per SM at best (~2 MB on the chip).
// Here each lane keeps the raw 16-byte vectors of the next PIPE key steps in a register
// ring (converted to fp32 only on use) and refills a slot as soon as it is converted, so
// PIPE steps stay in flight: 4 x 32 B x 128 threads = 16 KB per CTA, 48 KB per SM at the
// 3 resident CTAs of tile 4 and 32 KB at the 2 of tile 8.
//
// Math per key: scores live in the log2 domain (softmax.cuh; q pre-scaled by the variant's
// fold, scale * log2(e) without a soft-cap, one exp2 per query and key), the accumulator is rescaled only when the running max grows,
// which after the first keys is rare (exactly the same result: the skipped factor is
// exp2(0) = 1), the QB score reductions are interleaved (independent shuffle chains), and
// the causal limit of each query is a precomputed key count. Still ~170 warp instructions
// per KB at tile 4 (ptxas, sm_90), so at 16-bit d = 64 / 128 the tensor-core kernel
// (decode_mma.cu, ~20-40 per KB) takes over.
//
// Launch: grid (B * Hkv * n_qchunks, num_splits), block 128 (4 warps).
#include "decode_common.cuh"
#include "paged_kv.cuh"

template <class T, int D, int QB_>
struct DecodeShape {
    static constexpr int WARPS = 4;
    static_assert(WARPS * 32 == GQAKV_THREADS_PER_CTA, "4 warps per CTA");
    static_assert(gqakv_one_of(QB_, GQAKV_DECODE_QUERY_TILES), "QB is not in GQAKV_DECODE_QUERY_TILES");
    static constexpr int QB = QB_;                                // queries per CTA
    static constexpr int VEC = VecWidth<T, D>::value;             // elements per load
    static constexpr int NCH = D / VEC;                           // vectors per key row
    static constexpr int LPK = gqakv_cmin(32, gqakv_pow2_ceil(NCH));  // lanes per key
    static constexpr int CPL = (NCH + LPK - 1) / LPK;             // vectors per lane
    static constexpr int EPL = CPL * VEC;                         // elements per lane
    static constexpr int KPW = 32 / LPK;                          // keys per warp per step
    static constexpr int NG = WARPS * KPW;                        // keys per CTA per step
    // Key steps in flight per lane: ~128 B of K + V at 16-byte vectors (4 steps of one
    // vector pair, 2 of two); raw storage costs PIPE * CPL * 8 registers (16-byte vectors).
    static constexpr int PIPE = gqakv_cmax(1, 4 / CPL);
};

// Resident CTAs per SM each tile is compiled for (ptxas caps registers at 65536 / (128 *
// that)): limits.DECODE_CTAS_PER_SM, which the split planner also reads; the NVRTC test
// checks that the registers ptxas reports allow them.
template <int QB> struct DecodeOccupancy {
    static constexpr int value = gqakv_lookup(QB, GQAKV_DECODE_CTAS_PER_SM);
    static_assert(value > 0, "no GQAKV_DECODE_CTAS_PER_SM entry for this query tile");
};

// One 16-byte (or smaller) vector of N values of storage type T as it came from memory
// (N / PACK elements: 4-bit codes hold two values a byte), converted to fp32 only on use.
// Kept as 32-bit words where it fills them: a struct of eight 16-bit values would be split
// into eight 32-bit registers, twice the ring's register budget.
template <class T, int N, bool WORDS = (sizeof(T) * N / CodeLayout<T>::PACK) % 4 == 0>
struct RawVec {  // scalar fallback (16-bit types at odd head dims)
    Vec<T, N> x;
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int e = 0; e < N; ++e) x.v[e] = from_float<T>(0.f);
    }
    __device__ __forceinline__ void load(const T* __restrict__ p) { x = *reinterpret_cast<const Vec<T, N>*>(p); }
    __device__ __forceinline__ float get(int e) const { return to_float(x.v[e]); }
};

template <class T, int N>
struct RawVec<T, N, true> {
    static constexpr int PACK = CodeLayout<T>::PACK;
    static constexpr int NW = (int)sizeof(T) * N / PACK / 4;
    struct alignas(sizeof(T) * N / PACK) Words { unsigned w[NW]; };
    Words x;
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < NW; ++i) x.w[i] = 0u;
    }
    __device__ __forceinline__ void load(const T* __restrict__ p) { x = *reinterpret_cast<const Words*>(p); }
    __device__ __forceinline__ float get(int e) const {
        return word_to_float(x.w[e * (int)sizeof(T) / (4 * PACK)], e, (T*)0);
    }

  private:
    static __device__ __forceinline__ float word_to_float(unsigned w, int, float*) { return __uint_as_float(w); }
    template <class C>  // 8-bit codes (quantized_kv.cuh): byte e % 4 of the word
    static __device__ __forceinline__ float word_to_float(unsigned w, int e, C*) {
        return code_to_float((w >> (8 * (e % 4))) & 0xffu, (C*)0);
    }
    template <int G>  // 4-bit codes: nibble e % 8 of the word
    static __device__ __forceinline__ float word_to_float(unsigned w, int e, gqakv_i4g<G>*) {
        return nibble_to_float(w, e % 8);
    }
    static __device__ __forceinline__ float word_to_float(unsigned w, int e, gqakv_bf16*) {
        return __uint_as_float(e % 2 ? w & 0xffff0000u : w << 16);  // little-endian halves
    }
    static __device__ __forceinline__ float word_to_float(unsigned w, int e, gqakv_half*) {
        gqakv_half h;
        h.bits = (unsigned short)(e % 2 ? w >> 16 : w & 0xffffu);
        return to_float(h);
    }
};

// One lane's raw K and V vectors of one key step, and their scales (quantized readers
// only): the key's one K and V scale, or with grouped codes each vector's block's (a
// vector never straddles a block).
template <class T, int VEC, int CPL>
struct KVRaw {
    static constexpr int NSC = CodeLayout<T>::GROUP ? CPL : 1;
    RawVec<T, VEC> k[CPL];
    RawVec<T, VEC> v[CPL];
    float ks[NSC] = {}, vs[NSC] = {};
};

// Issue the loads of key `key`'s vectors of this lane (nothing when the key is not live:
// no byte at or past the split's end is read), asking the K/V reader for the key's rows.
// Lanes past the row's last vector keep their zeros.
template <class S, class T, class Reader>
__device__ __forceinline__ void fetch_kv(KVRaw<T, S::VEC, S::CPL>& r, const Reader& kv, i64 key,
                                         bool live, int sub) {
    if (!live) return;
    constexpr int PACK = CodeLayout<T>::PACK, NSC = KVRaw<T, S::VEC, S::CPL>::NSC;
    const T* kp = kv.k_row(key) + sub * S::VEC / PACK;
    const T* vp = kv.v_row(key) + sub * S::VEC / PACK;
#pragma unroll
    for (int c = 0; c < S::CPL; ++c) {
        const int ch = sub + c * S::LPK;
        if (ch < S::NCH) {
            r.k[c].load(kp + c * S::LPK * S::VEC / PACK);
            r.v[c].load(vp + c * S::LPK * S::VEC / PACK);
            if constexpr (Reader::SCALED) {
                if (c < NSC) {  // grouped: this vector's block; per token: the key's (c = 0)
                    r.ks[c] = kv.k_scale(key, ch * S::VEC);
                    r.vs[c] = kv.v_scale(key, ch * S::VEC);
                }
            }
        }
    }
}

// Online-softmax update of one query's state (softmax.cuh) with one key: score s, value v.
// The accumulator is rescaled only when the running max grows, rare after the first keys
// (the factor skipped otherwise is exactly exp2(0) = 1). A NaN score leaves m as it is and
// makes p, l and acc NaN; write_decode_rows turns that state into NaN out and lse.
template <int EPL>
__device__ __forceinline__ void softmax_update(float s, const float* v, SoftmaxState<true>& st, float* acc) {
    if (s > st.m) {
        const float corr = st.raise(s);  // 0 while the state is empty (m = -inf)
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[e] *= corr;
    }
    const float p = st.weight_raised(s);
    st.l += p;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[e] += p * v[e];
}

// T: the storage type (KernelTypes names its q / K/V / output roles); VARIANT: the
// variant trait's flags (variant.cuh; 0 is plain causal).
template <class T, int D, int QB, int VARIANT = 0, class... Pages>
__global__ void __launch_bounds__(128, DecodeOccupancy<QB>::value) gqakv_decode(
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
    typedef DecodeShape<KV, D, QB> S;
    typedef Variant<VARIANT> V;
    const DecodeCta cta = decode_cta<V>(lens, n_new, Hkv, n_qchunks, keys_per_split, params);
    const int qc = cta.qc, kvh = cta.kvh, b = cta.b, split = cta.split;
    const i64 L = cta.L, n = cta.n, k_begin = cta.k_begin, k_end = cta.k_end;
    if (n == 0) return;  // uniform over the CTA
    if (k_begin >= k_end) {  // uniform too: a split past this entry's keys
        write_empty_split(b, kvh, qc, S::QB, Hkv, G, Tq, n, num_splits, split, part_lse);
        return;
    }
    // Keys of this split, counted from k_begin: fits an int (the planner keeps
    // keys_per_split below 2^30).
    const int n_keys = (int)(k_end - k_begin);

    const int lane = threadIdx.x % 32;
    const int grp = (threadIdx.x / 32) * S::KPW + lane / S::LPK;  // key slot of this lane
    const int sub = lane % S::LPK;                                // position within the key row

    // Start the K/V stream before anything else: the first PIPE steps of this lane. Step
    // `step` of this lane is key k_begin + step * NG + grp, read through the K/V reader.
    const auto kv = kv_reader<Ty>(k_buf, v_buf, rows[b], kvh, buf_sb, buf_sh, buf_st, params, D, pages...);
    const i64 lane_key = k_begin + grp;
    KVRaw<KV, S::VEC, S::CPL> ring[S::PIPE];
#pragma unroll
    for (int u = 0; u < S::PIPE; ++u) {
#pragma unroll
        for (int c = 0; c < S::CPL; ++c) {
            ring[u].k[c].zero();
            ring[u].v[c].zero();
        }
        fetch_kv<S>(ring[u], kv, lane_key + u * S::NG, u * S::NG + grp < n_keys, sub);
    }

    // Queries of this tile, scaled by the variant's fold (scale * log2(e) without a
    // soft-cap: scores in the log2 domain), in registers: this lane's vectors of each
    // query. Query i sees the keys lo[i] <= j < lim[i] (from k_begin): lim[i] =
    // min(n_keys, key_hi - k_begin), lo[i] = max(0, key_lo - k_begin) (0 without a
    // window); lim[i] = 0 for a padding slot.
    const float qscale = V::fold(params);
    float qr[S::QB][S::EPL];
    int lim[S::QB], lo[S::QB];
    // ALiBi only: each query's head slope (log2 domain) and position from k_begin, so the
    // score hook sees key jr at offset jr - qrel from its query; in shared memory, read as
    // broadcasts in the key loop (registers are this kernel's budget: at tile 8 two more per
    // query spill).
    struct AlibiRow {
        float slope;
        int qrel;
    };
    __shared__ AlibiRow sm_alibi[V::ALIBI ? S::QB : 1];
#pragma unroll
    for (int i = 0; i < S::QB; ++i) {
        const int qi = qc * S::QB + i;
        const int g = qi / Tq, t = qi % Tq;
        const bool valid = qi < G * Tq && t < n;
        const i64 pos = L - n + t;
        const i64 seen = V::key_hi(pos) - k_begin;  // keys up to the query's position
        lim[i] = !valid || seen <= 0 ? 0 : (seen < n_keys ? (int)seen : n_keys);
        const i64 first = V::key_lo(params, pos) - k_begin;
        lo[i] = !V::WINDOW || first <= 0 ? 0 : (first < n_keys ? (int)first : n_keys);
        if (V::ALIBI && threadIdx.x == 0) {
            sm_alibi[i].slope = valid ? V::alibi_log2(params, kvh * G + g) : 0.f;
            sm_alibi[i].qrel = (int)(pos - k_begin);  // |pos - k_begin| < 2^31: keys_per_split < 2^30
        }
        const i64 q_off = (i64)b * q_sb + (i64)(kvh * G + g) * q_sh + (i64)t * q_st;
#pragma unroll
        for (int c = 0; c < S::CPL; ++c) {
            const int ch = sub + c * S::LPK;
            if (valid && ch < S::NCH) {
                load_vec<typename Ty::Q, S::VEC>(q + q_off + ch * S::VEC, &qr[i][c * S::VEC]);
#pragma unroll
                for (int e = 0; e < S::VEC; ++e) qr[i][c * S::VEC + e] *= qscale;
            } else {
#pragma unroll
                for (int e = 0; e < S::VEC; ++e) qr[i][c * S::VEC + e] = 0.f;
            }
        }
    }

    // Keys every real query sees, [lo_all, lim_all), and some query sees, [lo_any,
    // lim_any). Padding slots count for neither (their state is never written out); a real
    // query may see none of this split's keys (small T, a last split shorter than T, a
    // window), and then the first range is empty.
    int lim_all = n_keys, lim_any = 0, lo_all = 0, lo_any = n_keys;
#pragma unroll
    for (int i = 0; i < S::QB; ++i) {
        const int qi = qc * S::QB + i;
        if (qi < G * Tq && qi % Tq < n) {
            lim_all = lim[i] < lim_all ? lim[i] : lim_all;
            lim_any = lim[i] > lim_any ? lim[i] : lim_any;
            lo_all = lo[i] > lo_all ? lo[i] : lo_all;
            lo_any = lo[i] < lo_any ? lo[i] : lo_any;
        }
    }
    if (!V::WINDOW) lo_all = lo_any = 0;

    if (V::ALIBI) __syncthreads();  // sm_alibi is written (uniform over the CTA)

    // Online-softmax state per query (softmax.cuh; empty: m = -inf, l = 0, acc = 0).
    SoftmaxState<true> st[S::QB];
    float acc[S::QB][S::EPL];
#pragma unroll
    for (int i = 0; i < S::QB; ++i) {
        st[i].init();
#pragma unroll
        for (int e = 0; e < S::EPL; ++e) acc[i][e] = 0.f;
    }

    // Every lane runs the same number of steps (the shuffles need the whole warp); steps
    // come in turns of PIPE so that the ring slot of each step is a compile-time index.
    const int n_steps = (n_keys + S::NG - 1) / S::NG;
    for (int s0 = 0; s0 < n_steps; s0 += S::PIPE) {
#pragma unroll
        for (int u = 0; u < S::PIPE; ++u) {
            const int step = s0 + u;
            if (step >= n_steps) break;  // uniform over the CTA
            const int jr = step * S::NG + grp;  // key of this lane, from k_begin
            float kf[S::EPL], vf[S::EPL];
#pragma unroll
            for (int c = 0; c < S::CPL; ++c) {
#pragma unroll
                for (int e = 0; e < S::VEC; ++e) {
                    kf[c * S::VEC + e] = ring[u].k[c].get(e);
                    vf[c * S::VEC + e] = ring[u].v[c].get(e);
                }
            }
            // Quantized: code x scale in registers, exactly the stored (dequantized) value,
            // so everything after is the unquantized kernel's arithmetic.
            if constexpr (Ty::Reader::SCALED) {
                constexpr int NSC = KVRaw<KV, S::VEC, S::CPL>::NSC;
#pragma unroll
                for (int e = 0; e < S::EPL; ++e) {
                    kf[e] *= ring[u].ks[NSC > 1 ? e / S::VEC : 0];
                    vf[e] *= ring[u].vs[NSC > 1 ? e / S::VEC : 0];
                }
            }
            // Refill the slot with step + PIPE before computing this one.
            fetch_kv<S>(ring[u], kv, k_begin + jr + S::PIPE * S::NG, jr + S::PIPE * S::NG < n_keys, sub);
            // Scores of all QB queries first, their reductions interleaved (QB independent
            // shuffle chains hide each other's latency), then the softmax updates.
            float sc[S::QB];
#pragma unroll
            for (int i = 0; i < S::QB; ++i) {
                float a = 0.f, b2 = 0.f;  // two FMA chains: half the dependency depth
#pragma unroll
                for (int e = 0; e < S::EPL; e += 2) {
                    a += qr[i][e] * kf[e];
                    if (e + 1 < S::EPL) b2 += qr[i][e + 1] * kf[e + 1];
                }
                sc[i] = a + b2;
            }
#pragma unroll
            for (int off = S::LPK / 2; off > 0; off /= 2) {
#pragma unroll
                for (int i = 0; i < S::QB; ++i) sc[i] += __shfl_xor_sync(GQAKV_FULL_MASK, sc[i], off);
            }
            if (V::TRANSFORMS) {  // the score hook sees the whole dot product
#pragma unroll
                for (int i = 0; i < S::QB; ++i) {
                    const AlibiRow a = sm_alibi[V::ALIBI ? i : 0];
                    sc[i] = V::transform_at(params, sc[i], a.slope, (float)(jr - a.qrel));
                }
            }
            if (jr < lim_all && jr >= lo_all) {  // every real query sees this key (always, for T = 1)
#pragma unroll
                for (int i = 0; i < S::QB; ++i) softmax_update<S::EPL>(sc[i], vf, st[i], acc[i]);
            } else if (jr < lim_any && jr >= lo_any) {  // small T: keys hidden from some queries
#pragma unroll
                for (int i = 0; i < S::QB; ++i)
                    if (jr < lim[i] && jr >= lo[i]) softmax_update<S::EPL>(sc[i], vf, st[i], acc[i]);
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
            sm_m[grp][i] = st[i].m;
            sm_l[grp][i] = st[i].l;
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

    write_decode_rows<V, typename Ty::Out, D, S::QB, S::NG>(sm_m, sm_l, sm_acc, b, kvh, qc, Hkv, G, Tq, n,
                                                           num_splits, split, params, out, lse, part_o,
                                                           part_lse, o_sb, o_sh, o_st);
}
