// The online-softmax state and the LSE merge, written once for every attention kernel
// (decode.cu, decode_mma.cu, prefill.cu, prefill_mma.cu, the in-CTA merge of
// decode_common.cuh, merge.cu).
//
// One numeric convention: scores are in the log2 domain (a score s = scale * q.k, after
// the variant's transform, enters as s * log2(e); the variant trait folds that factor into
// the scale, variant.cuh), a state is (m, l) with m the running max of those scores and
// l = sum_j 2^(s_j - m), the accumulator holds sum_j 2^(s_j - m) v_j. A state is correct
// when empty (m = -inf, l = 0, acc = 0) and stays so through fully masked blocks. The
// natural-log LSE leaves a state only at the end: (m + log2 l) * ln 2.
//
// NaN: fmaxf skips a NaN score, so m never turns NaN, but its weight 2^(NaN - m) makes l
// (and acc) NaN for good; finishing writes NaN out and lse for that query (never hidden).
#pragma once
#include "common.cuh"

#define GQAKV_LOG2E 1.4426950408889634f
#define GQAKV_LN2 0.6931471805599453f

// 2^x in fp32 (one MUFU.EX2 on the GPU; the flush of results below 2^-126 to 0 is far
// below the fp32 accumulation error of a softmax weight).
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef GQAKV_EMULATION
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// 2^x: the approximate hardware instruction (decode) or the accurate exp2f (prefill).
template <bool FAST>
__device__ __forceinline__ float softmax_exp2(float x) {
    return FAST ? fast_exp2(x) : exp2f(x);
}

// One query's running max and sum (log2 domain). FAST picks the exp2 (softmax_exp2).
template <bool FAST>
struct SoftmaxState {
    float m, l;

    __device__ __forceinline__ void init() {
        m = GQAKV_NEG_INF;
        l = 0.f;
    }
    // Raise the running max to x when x is larger; returns the factor the accumulator must
    // be multiplied by (exactly 1 when the max does not move, 0 while the state is empty).
    __device__ __forceinline__ float raise(float x) {
        if (!(x > m)) return 1.f;
        const float corr = softmax_exp2<FAST>(m - x);
        l *= corr;
        m = x;
        return corr;
    }
    // The exponent base of this block's weights: m, or 0 while m is -inf (a masked score
    // then gets 2^(-inf - 0) = 0 instead of 2^(-inf + inf) = NaN).
    __device__ __forceinline__ float base() const { return m == GQAKV_NEG_INF ? 0.f : m; }
    // Weight of a score s after raise(s) (so s <= m, or s NaN): no empty-state guard needed.
    __device__ __forceinline__ float weight_raised(float s) const { return softmax_exp2<FAST>(s - m); }
    // Weight of a score s against base() (blocked kernels: the max raised to the block's).
    __device__ __forceinline__ float weight(float s, float mu) const { return softmax_exp2<FAST>(s - mu); }
};

// ---- merging states (in-CTA key slots, split-KV partials) and finishing ---------------------

// The weight of a part whose state max (log2 domain) is m_s in a merge whose max is mx
// (mx finite): 0 for a part that saw no finite score (m_s = -inf).
__device__ __forceinline__ float merge_weight_log2(float m_s, float mx) { return fast_exp2(m_s - mx); }

// The weight of a split-KV partial with natural-log LSE lse_s when the largest is mx (mx
// finite): the difference is taken before the change of base, so large LSEs lose nothing.
__device__ __forceinline__ float merge_weight_lse(float lse_s, float mx) {
    return exp2f((lse_s - mx) * GQAKV_LOG2E);
}

// A sink logit (log2 domain) added once to a finished state (m, total) that saw keys
// (total > 0 or NaN): total gains 2^(sink - m), rescaled when the sink is the larger.
// Returns the factor for the accumulator. A state that saw no key is left as it is (out 0,
// lse -inf, as without sinks); a sink of -inf changes nothing.
__device__ __forceinline__ float add_sink_log2(float& m, float& total, float sink) {
    if (total == 0.f || !(sink > GQAKV_NEG_INF)) return 1.f;
    // One exponential either way (2^-|sink - m|), the approximate instruction as in the
    // key loops: a second accurate exp2f call costs the merge kernel a stack frame.
    const float w = fast_exp2(-fabsf(sink - m));
    if (sink > m) {
        total = total * w + 1.f;
        m = sink;
        return w;
    }
    total += w;
    return 1.f;
}

// The natural-log LSE of a finished state: (m + log2 total) * ln 2; -inf when it saw no
// key (total = 0); NaN when a score was NaN (total NaN).
__device__ __forceinline__ float finished_lse(float m, float total) {
    return total != 0.f ? (m + log2f(total)) * GQAKV_LN2 : GQAKV_NEG_INF;
}

// The output factor of a finished state: 1 / total, or 0 when it saw no key.
__device__ __forceinline__ float finished_scale(float total) { return total != 0.f ? 1.f / total : 0.f; }
