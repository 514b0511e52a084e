// Emulation driver: the gqakv kernels compiled for the CPU, launched by name with CUDA's
// kernelParams convention (an array of pointers to the argument values), from Python via
// ctypes (tests/cuda_emu/harness.py). Built with g++ -include cuda_emu.h, optionally with
// -fsanitize=address; then emu_poison marks bytes a kernel must never touch.
#include <chrono>
#include <cstring>
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

// The kernel registrations of this build unit: generated from the instantiation table
// (backends/cupy_backend/instantiations.py) by tests/cuda_emu/harness.py, one line per
// entry, registry()["name"] = make_entry(&name); (the name expression is a template-id).
void register_kernels() {
#ifdef GQAKV_EMU_REGISTRATIONS
#include GQAKV_EMU_REGISTRATIONS
#endif
}

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
        register_kernels();
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

// The registered names, one per line (harness.Emulator.kernel_names), written into buf
// (NUL-terminated when it fits); returns the bytes needed without the NUL.
size_t emu_kernel_names(char* buf, size_t size) {
    std::string all;
    for (const auto& kv : gqakv_emu::registry()) all += kv.first + "\n";
    if (buf && size > all.size()) std::memcpy(buf, all.c_str(), all.size() + 1);
    return all.size();
}

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
