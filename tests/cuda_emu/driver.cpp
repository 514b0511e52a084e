// Emulation driver: the gqakv kernels compiled for the CPU, launched by name with CUDA's
// kernelParams convention (an array of pointers to the argument values), from Python via
// ctypes (tests/cuda_emu/harness.py). Built with g++ -include cuda_emu.h, optionally with
// -fsanitize=address; then emu_poison marks bytes a kernel must never touch.
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "write_kv.cu"
#include "write_kv_quantized.cu"
#include "copy_tokens.cu"
#include "decode.cu"
#include "decode_mma.cu"
#include "merge.cu"
#include "prefill.cu"
#include "prefill_mma.cu"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace gqakv_emu {
Block g_block;
thread_local unsigned g_tid;
thread_local uint64_t g_sync_count, g_warp_count;
std::atomic<uint64_t> g_progress{0};

// Aborts the process when no barrier of the running launch completes for the limit.
class Watchdog {
  public:
    Watchdog() : thread_([this] { watch(); }) {}
    ~Watchdog() {
        {
            std::lock_guard<std::mutex> lk(m_);
            done_ = true;
        }
        cv_.notify_one();
        thread_.join();
    }

  private:
    static double limit_seconds() {
        const char* env = std::getenv("GQAKV_EMU_DEADLOCK_S");
        const double v = env ? std::atof(env) : 0.0;
        return v > 0 ? v : 300.0;
    }
    void watch() {
        const auto limit = std::chrono::duration<double>(limit_seconds());
        uint64_t last = g_progress.load();
        auto since = std::chrono::steady_clock::now();
        std::unique_lock<std::mutex> lk(m_);
        while (!cv_.wait_for(lk, std::chrono::milliseconds(200), [this] { return done_; })) {
            const uint64_t now = g_progress.load();
            if (now != last) {
                last = now;
                since = std::chrono::steady_clock::now();
            } else if (std::chrono::steady_clock::now() - since > limit) {
                fail("deadlock: no barrier completed within GQAKV_EMU_DEADLOCK_S; threads wait at "
                     "a __syncthreads or warp collective that others of their block or warp never reach");
            }
        }
    }
    std::mutex m_;
    std::condition_variable cv_;
    bool done_ = false;
    std::thread thread_;
};
void fail(const char* what) {
    std::fprintf(stderr, "cuda_emu: %s\n", what);
    std::abort();
}

struct Entry {
    std::vector<size_t> arg_sizes;
    std::function<void(void**)> call;
};

template <class... A, size_t... I>
void call_with(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*static_cast<A*>(args[I])...);
}

template <class... A>
Entry make_entry(void (*k)(A...)) {
    return Entry{{sizeof(A)...}, [k](void** args) { call_with(k, args, std::index_sequence_for<A...>{}); }};
}

std::map<std::string, Entry>& registry() {
    static std::map<std::string, Entry> r;
    return r;
}

#define GQAKV_REG(K, T, D) registry()[#K "<" #T ", " #D ">"] = make_entry(&K<T, D>);
// The tensor-core prefill exists for 16-bit types and head dims that are a multiple of
// GQAKV_PREFILL_MMA_HEAD_DIM_MULTIPLE (limits.py; sources.prefill_mma_supported).
template <class T, int D>
void register_prefill_mma(const char* name) {
    if constexpr (sizeof(T) == 2 && D % GQAKV_PREFILL_MMA_HEAD_DIM_MULTIPLE == 0)
        registry()[name] = make_entry(&gqakv_prefill_mma<T, D>);
}
#define GQAKV_REG_PREFILL_MMA(T, D) register_prefill_mma<T, D>("gqakv_prefill_mma<" #T ", " #D ">");
// The tensor-core decode exists for 16-bit types at GQAKV_DECODE_MMA_HEAD_DIMS (limits.py;
// sources.decode_mma_supported).
template <class T, int D>
void register_decode_mma(const char* name) {
    if constexpr (sizeof(T) == 2 && gqakv_one_of(D, GQAKV_DECODE_MMA_HEAD_DIMS))
        registry()[name] = make_entry(&gqakv_decode_mma<T, D>);
}
#define GQAKV_REG_DECODE_MMA(T, D) register_decode_mma<T, D>("gqakv_decode_mma<" #T ", " #D ">");
// The decode kernel at every query tile of GQAKV_DECODE_QUERY_TILES (limits.py), named as
// sources.name_expression spells it.
template <class T, int D, int... QB>
void register_decode(const char* type_name) {
    ((registry()["gqakv_decode<" + std::string(type_name) + ", " + std::to_string(D) + ", " +
                 std::to_string(QB) + ">"] = make_entry(&gqakv_decode<T, D, QB>)),
     ...);
}
#define GQAKV_REG_DECODE(T, D) register_decode<T, D, GQAKV_DECODE_QUERY_TILES>(#T);
#define GQAKV_REG_ALL(T, D)                \
    GQAKV_REG(gqakv_write_kv, T, D)        \
    GQAKV_REG(gqakv_copy_tokens, T, D)     \
    GQAKV_REG_DECODE(T, D)                 \
    GQAKV_REG_DECODE_MMA(T, D)             \
    GQAKV_REG(gqakv_merge, T, D)           \
    GQAKV_REG(gqakv_prefill, T, D)         \
    GQAKV_REG_PREFILL_MMA(T, D)
#define GQAKV_REG_DIM(D) GQAKV_REG_ALL(float, D) GQAKV_REG_ALL(gqakv_half, D) GQAKV_REG_ALL(gqakv_bf16, D)

// The variant instantiations (kernels/variant.cuh flags: window 1, softcap 2, sinks 4, alibi 8)
// of the attention kernels, named as sources.name_expression spells them ("..., flags>");
// gqakv_merge only with the sinks flag (the planner passes it flags & 4).
template <class T, int D, int V, int... QB>
void register_variant_decode(const std::string& td, const std::string& v) {
    ((registry()["gqakv_decode<" + td + ", " + std::to_string(QB) + v] = make_entry(&gqakv_decode<T, D, QB, V>)),
     ...);
}
template <class T, int D, int V>
void register_variant(const std::string& type_name) {
    const std::string td = type_name + ", " + std::to_string(D);
    const std::string v = ", " + std::to_string(V) + ">";
    register_variant_decode<T, D, V, GQAKV_DECODE_QUERY_TILES>(td, v);
    registry()["gqakv_prefill<" + td + v] = make_entry(&gqakv_prefill<T, D, V>);
    if constexpr (sizeof(T) == 2 && gqakv_one_of(D, GQAKV_DECODE_MMA_HEAD_DIMS))
        registry()["gqakv_decode_mma<" + td + v] = make_entry(&gqakv_decode_mma<T, D, V>);
    if constexpr (sizeof(T) == 2 && D % GQAKV_PREFILL_MMA_HEAD_DIM_MULTIPLE == 0)
        registry()["gqakv_prefill_mma<" + td + v] = make_entry(&gqakv_prefill_mma<T, D, V>);
    if constexpr (V == GQAKV_VARIANT_SINKS)
        registry()["gqakv_merge<" + td + v] = make_entry(&gqakv_merge<T, D, V>);
}
template <class T, int D, int... V>
void register_variants(const char* type_name) {
    (register_variant<T, D, V>(type_name), ...);
}
// Flags 1..7, and ALiBi alone (8) and with every other feature (15): the combinations the
// product and the ALiBi tests run (each flag set costs a build of every attention kernel).
#define GQAKV_REG_VARIANTS(T, D) register_variants<T, D, 1, 2, 3, 4, 5, 6, 7, 8, 15>(#T);
#define GQAKV_REG_VARIANTS_DIM(D) \
    GQAKV_REG_VARIANTS(float, D) GQAKV_REG_VARIANTS(gqakv_half, D) GQAKV_REG_VARIANTS(gqakv_bf16, D)

// The paged instantiations (kernels/paged_kv.cuh: the K/V pack names KVPages) of the
// append and the attention kernels, named as sources.paged_name_expression spells them
// ("..., flags, KVPages>"; the append has no flags), for the variant flags listed.
template <class T, int D, int V, int... QB>
void register_paged_decode(const std::string& td, const std::string& v) {
    ((registry()["gqakv_decode<" + td + ", " + std::to_string(QB) + v] =
          make_entry(&gqakv_decode<T, D, QB, V, KVPages>)),
     ...);
}
template <class T, int D, int V>
void register_paged(const std::string& type_name) {
    const std::string td = type_name + ", " + std::to_string(D);
    const std::string v = ", " + std::to_string(V) + ", KVPages>";
    if constexpr (V == 0)
        registry()["gqakv_write_kv<" + td + ", KVPages>"] = make_entry(&gqakv_write_kv<T, D, KVPages>);
    register_paged_decode<T, D, V, GQAKV_DECODE_QUERY_TILES>(td, v);
    registry()["gqakv_prefill<" + td + v] = make_entry(&gqakv_prefill<T, D, V, KVPages>);
    if constexpr (sizeof(T) == 2 && gqakv_one_of(D, GQAKV_DECODE_MMA_HEAD_DIMS))
        registry()["gqakv_decode_mma<" + td + v] = make_entry(&gqakv_decode_mma<T, D, V, KVPages>);
    if constexpr (sizeof(T) == 2 && D % GQAKV_PREFILL_MMA_HEAD_DIM_MULTIPLE == 0)
        registry()["gqakv_prefill_mma<" + td + v] = make_entry(&gqakv_prefill_mma<T, D, V, KVPages>);
}
template <class T, int D, int... V>
void register_paged_variants(const char* type_name) {
    (register_paged<T, D, V>(type_name), ...);
}
#define GQAKV_REG_PAGED(T, D, ...) register_paged_variants<T, D, __VA_ARGS__>(#T);
#define GQAKV_REG_PAGED_DIM(D, ...)                                     \
    GQAKV_REG_PAGED(float, D, __VA_ARGS__) GQAKV_REG_PAGED(gqakv_half, D, __VA_ARGS__) \
    GQAKV_REG_PAGED(gqakv_bf16, D, __VA_ARGS__)
// The quantized-cache instantiations (kernels/quantized_kv.cuh), named as
// sources.name_expression spells them with kv_dtype: the quantizing append
// <T, C, D>, the code and scale copies <C, D> and <float, 1>, decode and prefill over
// gqakv_quantized<T, C> (merge reads fp32 partials: its plain instantiations serve).
template <class T, class C, int D, int... QB>
void register_quantized(const std::string& type_name, const std::string& code_name) {
    const std::string d = std::to_string(D);
    const std::string qt = "gqakv_quantized<" + type_name + ", " + code_name + ">, " + d;
    registry()["gqakv_write_kv_quantized<" + type_name + ", " + code_name + ", " + d + ">"] =
        make_entry(&gqakv_write_kv_quantized<T, C, D>);
    registry()["gqakv_copy_tokens<" + code_name + ", " + d + ">"] = make_entry(&gqakv_copy_tokens<C, D>);
    registry()["gqakv_copy_tokens<float, 1>"] = make_entry(&gqakv_copy_tokens<float, 1>);
    ((registry()["gqakv_decode<" + qt + ", " + std::to_string(QB) + ">"] =
          make_entry(&gqakv_decode<gqakv_quantized<T, C>, D, QB>)),
     ...);
    registry()["gqakv_prefill<" + qt + ">"] = make_entry(&gqakv_prefill<gqakv_quantized<T, C>, D>);
}
template <class T, class C, int D, int V>
void register_quantized_variant(const std::string& type_name, const std::string& code_name) {
    const std::string qt = "gqakv_quantized<" + type_name + ", " + code_name + ">, " + std::to_string(D);
    const std::string v = ", " + std::to_string(V) + ">";
    register_variant_decode<gqakv_quantized<T, C>, D, V, GQAKV_DECODE_QUERY_TILES>(qt, v);
    registry()["gqakv_prefill<" + qt + v] = make_entry(&gqakv_prefill<gqakv_quantized<T, C>, D, V>);
}
template <class T, class C, int D, int... V>
void register_quantized_variants(const char* type_name, const char* code_name) {
    (register_quantized_variant<T, C, D, V>(type_name, code_name), ...);
}
#define GQAKV_REG_QUANTIZED(T, C, D) register_quantized<T, C, D, GQAKV_DECODE_QUERY_TILES>(#T, #C);
#define GQAKV_REG_QUANTIZED_DIM(D)                                                          \
    GQAKV_REG_QUANTIZED(float, gqakv_i8, D) GQAKV_REG_QUANTIZED(float, gqakv_e4m3, D)       \
    GQAKV_REG_QUANTIZED(gqakv_half, gqakv_i8, D) GQAKV_REG_QUANTIZED(gqakv_half, gqakv_e4m3, D) \
    GQAKV_REG_QUANTIZED(gqakv_bf16, gqakv_i8, D) GQAKV_REG_QUANTIZED(gqakv_bf16, gqakv_e4m3, D)
#define GQAKV_REG_QUANTIZED_VARIANTS(T, C, D) register_quantized_variants<T, C, D, 1, 2, 3, 4, 5, 6, 7, 8, 15>(#T, #C);
#define GQAKV_REG_QUANTIZED_VARIANTS_DIM(D) \
    GQAKV_REG_QUANTIZED_VARIANTS(float, gqakv_i8, D) GQAKV_REG_QUANTIZED_VARIANTS(float, gqakv_e4m3, D) \
    GQAKV_REG_QUANTIZED_VARIANTS(gqakv_bf16, gqakv_i8, D) GQAKV_REG_QUANTIZED_VARIANTS(gqakv_bf16, gqakv_e4m3, D)
// The paged 8-bit instantiations (QuantizedKV over PagedKV), named as
// sources.paged_name_expression spells them with kv_dtype: the quantizing append into
// pages <T, C, D, KVPages> (with flags 0), decode and prefill over gqakv_quantized<T, C>
// ("..., flags, KVPages>"; merge: the plain instantiations serve).
template <class T, class C, int D, int V>
void register_paged_quantized(const std::string& type_name, const std::string& code_name) {
    const std::string d = std::to_string(D);
    const std::string qt = "gqakv_quantized<" + type_name + ", " + code_name + ">, " + d;
    const std::string v = ", " + std::to_string(V) + ", KVPages>";
    if constexpr (V == 0)
        registry()["gqakv_write_kv_quantized<" + type_name + ", " + code_name + ", " + d + ", KVPages>"] =
            make_entry(&gqakv_write_kv_quantized<T, C, D, KVPages>);
    register_paged_decode<gqakv_quantized<T, C>, D, V, GQAKV_DECODE_QUERY_TILES>(qt, v);
    registry()["gqakv_prefill<" + qt + v] = make_entry(&gqakv_prefill<gqakv_quantized<T, C>, D, V, KVPages>);
}
template <class T, class C, int D, int... V>
void register_paged_quantized_variants(const char* type_name, const char* code_name) {
    (register_paged_quantized<T, C, D, V>(type_name, code_name), ...);
}
#define GQAKV_REG_PAGED_QUANTIZED(T, C, D, ...) register_paged_quantized_variants<T, C, D, __VA_ARGS__>(#T, #C);
#define GQAKV_REG_PAGED_QUANTIZED_DIM(D, ...)                                                          \
    GQAKV_REG_PAGED_QUANTIZED(float, gqakv_i8, D, __VA_ARGS__) GQAKV_REG_PAGED_QUANTIZED(float, gqakv_e4m3, D, __VA_ARGS__) \
    GQAKV_REG_PAGED_QUANTIZED(gqakv_bf16, gqakv_i8, D, __VA_ARGS__)                                    \
    GQAKV_REG_PAGED_QUANTIZED(gqakv_bf16, gqakv_e4m3, D, __VA_ARGS__)
// q in every dtype (a one-dim library's paged 8-bit caches: the parity suite's small head dims).
#define GQAKV_REG_PAGED_QUANTIZED_ALL_DIM(D, ...)                                                      \
    GQAKV_REG_PAGED_QUANTIZED_DIM(D, __VA_ARGS__) GQAKV_REG_PAGED_QUANTIZED(gqakv_half, gqakv_i8, D, __VA_ARGS__) \
    GQAKV_REG_PAGED_QUANTIZED(gqakv_half, gqakv_e4m3, D, __VA_ARGS__)
// q in float32 only (what the product suite's quantized caches take).
#define GQAKV_REG_QUANTIZED_VARIANTS_F32_DIM(D) \
    GQAKV_REG_QUANTIZED_VARIANTS(float, gqakv_i8, D) GQAKV_REG_QUANTIZED_VARIANTS(float, gqakv_e4m3, D)

// Emulator self-test (tests/test_cuda_emu_mma.py): one warp runs one mma_m16n8k16 on the
// fragment registers given per lane: a [32][4], b [32][2], c [32][4] in, d [32][4] out.
template <class T>
__global__ void emu_mma_selftest(const unsigned* a, const unsigned* b, const float* c, float* d) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned ra[4] = {a[lane * 4], a[lane * 4 + 1], a[lane * 4 + 2], a[lane * 4 + 3]};
    const unsigned rb[2] = {b[lane * 2], b[lane * 2 + 1]};
    float acc[4] = {c[lane * 4], c[lane * 4 + 1], c[lane * 4 + 2], c[lane * 4 + 3]};
    mma_m16n8k16<T>(acc, ra, rb);
    for (int i = 0; i < 4; ++i) d[lane * 4 + i] = acc[i];
}

// Emulator self-tests of the divergence checks (tests/test_cupy_review.py): `mode` picks a
// pattern; 0 is uniform and must run, every other one must abort with its message.
//   1: lanes 0..15 shuffle, lanes 16..31 return   2: half the block skips __syncthreads
//   3: lanes 0..15 and 16..31 at different shuffles (lane masks 1 and 2)
//   4: lanes 0..15 at an mma, lanes 16..31 at a shuffle
//   5: lane 0 at an extra shuffle while the rest of the block waits at __syncthreads
//      (a deadlock: caught by the watchdog)
__global__ void emu_divergence_selftest(int mode, float* out) {
    const unsigned lane = threadIdx.x % 32;
    float x = (float)threadIdx.x;
    if (mode == 1 && lane >= 16) return;
    if (mode == 2 && threadIdx.x >= 64) return;
    if (mode == 3 && lane >= 16) {
        x += __shfl_xor_sync(GQAKV_FULL_MASK, x, 2);
    } else if (mode == 4 && lane < 16) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const unsigned a[4] = {0u, 0u, 0u, 0u}, b[2] = {0u, 0u};
        mma_m16n8k16<gqakv_half>(acc, a, b);
        x += acc[0];
    } else if (mode != 2) {
        x += __shfl_xor_sync(GQAKV_FULL_MASK, x, 1);
    }
    if (mode == 5 && threadIdx.x == 0) x += __shfl_xor_sync(GQAKV_FULL_MASK, x, 2);
    __syncthreads();
    x += __shfl_xor_sync(GQAKV_FULL_MASK, x, 4);
    out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}

struct Init {
    Init() {
        GQAKV_EMU_HEAD_DIMS
        registry()["emu_mma_selftest<gqakv_half>"] = make_entry(&emu_mma_selftest<gqakv_half>);
        registry()["emu_mma_selftest<gqakv_bf16>"] = make_entry(&emu_mma_selftest<gqakv_bf16>);
        registry()["emu_divergence_selftest"] = make_entry(&emu_divergence_selftest);
    }
} init;
}  // namespace gqakv_emu

extern "C" {

// 0 ok; 1 unknown kernel; 2 argument count/size mismatch; 3 bad launch shape.
int emu_launch(const char* name, const unsigned* grid, const unsigned* block, void** args,
               const size_t* arg_sizes, int nargs) {
    using namespace gqakv_emu;
    auto it = registry().find(name);
    if (it == registry().end()) return 1;
    const Entry& e = it->second;
    if ((size_t)nargs != e.arg_sizes.size()) return 2;
    for (int i = 0; i < nargs; ++i)
        if (arg_sizes[i] != e.arg_sizes[i]) return 2;
    const unsigned nthreads = block[0] * block[1] * block[2];
    if (nthreads == 0 || nthreads % 32 || nthreads > 1024 || grid[0] == 0 ||
        grid[0] > (unsigned)GQAKV_MAX_GRID_X || grid[1] == 0 || grid[1] > GQAKV_MAX_GRID_Y ||
        grid[2] == 0 || grid[2] > GQAKV_MAX_GRID_Y)
        return 3;  // CUDA's limits (limits.py): gridDim.x < 2^31, y and z <= 65535, none 0
    gridDim = dim3{grid[0], grid[1], grid[2]};
    blockDim = dim3{block[0], block[1], block[2]};
    std::barrier<> block_bar(nthreads);
    std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
    std::vector<Warp> warps(nthreads / 32);
    for (auto& w : warps) {
        warp_bars.emplace_back(new std::barrier<>(32));
        w.bar = warp_bars.back().get();
    }
    std::vector<uint64_t> sync_even(nthreads, 0), sync_odd(nthreads, 0);
    g_block = Block{&block_bar, warps.data(), nthreads, {sync_even.data(), sync_odd.data()}};
    Watchdog watchdog;  // declared before the threads: joined after them
    std::vector<std::thread> threads;
    for (unsigned tid = 0; tid < nthreads; ++tid) {
        threads.emplace_back([&, tid] {
            g_tid = tid;
            g_sync_count = g_warp_count = 0;
            threadIdx = dim3{tid % block[0], (tid / block[0]) % block[1], tid / (block[0] * block[1])};
            for (unsigned z = 0; z < grid[2]; ++z)
                for (unsigned y = 0; y < grid[1]; ++y)
                    for (unsigned x = 0; x < grid[0]; ++x) {
                        blockIdx = dim3{x, y, z};
                        e.call(args);
                        // Leaving the kernel is a warp-level event too: a lane that returns
                        // while the rest of its warp waits at a collective meets them here.
                        Warp& w = warps[tid / 32];
                        w.seq[tid % 32] = warp_tag(EMU_EXIT, 0);
                        w.bar->arrive_and_wait();
                        check_warp_converged(w, "a lane left the kernel while others of its warp were at a warp collective");
                        block_bar.arrive_and_wait();  // the next block starts when all are done
                        if (tid == 0) g_progress.fetch_add(1, std::memory_order_relaxed);
                    }
        });
    }
    for (auto& t : threads) t.join();
    return 0;
}

int emu_has_kernel(const char* name) { return gqakv_emu::registry().count(name) ? 1 : 0; }

void* emu_alloc(size_t nbytes) { return std::malloc(nbytes ? nbytes : 1); }
void emu_free(void* p) { std::free(p); }

// Mark [p, p + n) as never to be read or written (AddressSanitizer builds only).
int emu_poison(void* p, size_t n) {
#if defined(__SANITIZE_ADDRESS__)
    ASAN_POISON_MEMORY_REGION(p, n);
    return 1;
#else
    (void)p; (void)n;
    return 0;
#endif
}
void emu_unpoison(void* p, size_t n) {
#if defined(__SANITIZE_ADDRESS__)
    ASAN_UNPOISON_MEMORY_REGION(p, n);
#else
    (void)p; (void)n;
#endif
}
}
