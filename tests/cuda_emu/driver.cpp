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
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

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

dim3 threadIdx;
dim3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace gqakv_emu {
Block g_block;
unsigned g_tid;
uint64_t g_sync_count, g_warp_count;
std::atomic<uint64_t> g_progress{0};

// -- fibers: the block's CUDA threads, run in turn on the launching thread ----------------
// A fiber runs until it waits at a Barrier that is not complete (or leaves the kernel);
// the scheduler (emu_launch) then resumes the next fiber whose barrier has completed. The
// per-thread globals (g_tid, the counts, threadIdx, blockIdx) are the running fiber's:
// the scheduler swaps them in and out around each turn.
struct Fiber {
    ucontext_t ctx;
    unsigned tid = 0;
    bool done = false;
    const Barrier* wait = nullptr;  // the barrier it waits at, in phase wait_phase
    uint64_t wait_phase = 0;
    uint64_t sync_count = 0, warp_count = 0;
    dim3 thread_idx, block_idx;
    void* fake_stack = nullptr;  // AddressSanitizer's, while switched out
};

// What every fiber of the running launch runs (set by emu_launch).
struct Launch {
    std::function<void(void**)> const* call;
    void** args;
    dim3 grid;
    Warp* warps;
    Barrier* block_bar;
};
Launch g_launch;
Fiber* g_current = nullptr;
ucontext_t g_scheduler;
// The scheduler's stack as AddressSanitizer reports it on the first switch into a fiber.
const void* g_scheduler_bottom = nullptr;
size_t g_scheduler_size = 0;

// AddressSanitizer is told of every switch between stacks (its fiber annotations), so it
// checks each fiber's stack as a stack; without it these do nothing.
inline void start_switch(void** fake_save, const void* bottom, size_t size) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
    (void)fake_save; (void)bottom; (void)size;
#endif
}
inline void finish_switch(void* fake_save, const void** bottom_old, size_t* size_old) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fake_save, bottom_old, size_old);
#else
    (void)fake_save; (void)bottom_old; (void)size_old;
#endif
}

void Barrier::arrive_and_wait() {
    const uint64_t mine = phase;
    if (++arrived == expected) {  // complete: the waiting fibers may go on; this one does
        arrived = 0;
        ++phase;
        return;
    }
    Fiber* f = g_current;
    f->wait = this;
    f->wait_phase = mine;
    start_switch(&f->fake_stack, g_scheduler_bottom, g_scheduler_size);
    swapcontext(&f->ctx, &g_scheduler);
    finish_switch(f->fake_stack, &g_scheduler_bottom, &g_scheduler_size);
}

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

namespace gqakv_emu {
// A fiber's whole life: CUDA thread g_current->tid of every block of the launch, in order.
void fiber_main() {
    finish_switch(nullptr, &g_scheduler_bottom, &g_scheduler_size);
    Fiber* f = g_current;
    const unsigned tid = f->tid;
    const Launch& L = g_launch;
    for (unsigned z = 0; z < L.grid.z; ++z)
        for (unsigned y = 0; y < L.grid.y; ++y)
            for (unsigned x = 0; x < L.grid.x; ++x) {
                blockIdx = dim3{x, y, z};
                (*L.call)(L.args);
                // Leaving the kernel is a warp-level event too: a lane that returns while
                // the rest of its warp waits at a collective meets them here.
                Warp& w = L.warps[tid / 32];
                w.seq[tid % 32] = warp_tag(EMU_EXIT, 0);
                w.bar->arrive_and_wait();
                check_warp_converged(w, "a lane left the kernel while others of its warp were at a warp collective");
                L.block_bar->arrive_and_wait();  // the next block starts when all are done
                if (tid == 0) g_progress.fetch_add(1, std::memory_order_relaxed);
            }
    f->done = true;
    start_switch(nullptr, g_scheduler_bottom, g_scheduler_size);  // this stack is done
    setcontext(&g_scheduler);
}

// Each fiber's stack, with an inaccessible page below it (an overflow faults, not corrupts).
// The kernels' frames are a few KiB, AddressSanitizer's a few times more. Mapped without
// reserve: only the pages a fiber touches are allocated. Smaller under AddressSanitizer:
// its swapcontext clears the shadow of the whole stack switched to, at every switch.
class Stacks {
  public:
#if defined(__SANITIZE_ADDRESS__)
    static constexpr size_t kSize = size_t(256) << 10;
#else
    static constexpr size_t kSize = size_t(1) << 20;
#endif
    explicit Stacks(unsigned n) : page_((size_t)sysconf(_SC_PAGESIZE)), n_(n) {
        bytes_ = n_ * (kSize + page_);
        base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base_ == MAP_FAILED) fail("could not map the fibers' stacks");
        for (unsigned i = 0; i < n_; ++i)
            if (mprotect(static_cast<char*>(base_) + i * (kSize + page_), page_, PROT_NONE))
                fail("could not protect a fiber stack's guard page");
    }
    ~Stacks() { munmap(base_, bytes_); }
    void* bottom(unsigned i) const { return static_cast<char*>(base_) + i * (kSize + page_) + page_; }

  private:
    size_t page_, bytes_ = 0;
    unsigned n_;
    void* base_ = nullptr;
};
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
    Barrier block_bar{nthreads};
    std::vector<Barrier> warp_bars(nthreads / 32, Barrier{32});
    std::vector<Warp> warps(nthreads / 32);
    for (size_t i = 0; i < warps.size(); ++i) warps[i].bar = &warp_bars[i];
    std::vector<uint64_t> sync_even(nthreads, 0), sync_odd(nthreads, 0);
    g_block = Block{&block_bar, warps.data(), nthreads, {sync_even.data(), sync_odd.data()}};
    g_launch = Launch{&e.call, args, gridDim, warps.data(), &block_bar};
    Stacks stacks(nthreads);
    std::vector<Fiber> fibers(nthreads);
    for (unsigned tid = 0; tid < nthreads; ++tid) {
        Fiber& f = fibers[tid];
        f.tid = tid;
        f.thread_idx = dim3{tid % block[0], (tid / block[0]) % block[1], tid / (block[0] * block[1])};
        if (getcontext(&f.ctx)) fail("getcontext failed");
        f.ctx.uc_stack.ss_sp = stacks.bottom(tid);
        f.ctx.uc_stack.ss_size = Stacks::kSize;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
    }
    Watchdog watchdog;  // a thread that never reaches its next barrier
    // Sweep the fibers in index order, each that can go on for one turn, until all are done.
    for (unsigned alive = nthreads; alive > 0;) {
        bool ran = false;
        for (Fiber& f : fibers) {
            if (f.done || (f.wait && f.wait->phase == f.wait_phase)) continue;
            f.wait = nullptr;
            g_current = &f;
            g_tid = f.tid;
            g_sync_count = f.sync_count;
            g_warp_count = f.warp_count;
            threadIdx = f.thread_idx;
            blockIdx = f.block_idx;
            void* fake = nullptr;
            start_switch(&fake, stacks.bottom(f.tid), Stacks::kSize);
            swapcontext(&g_scheduler, &f.ctx);
            finish_switch(fake, nullptr, nullptr);
            f.sync_count = g_sync_count;
            f.warp_count = g_warp_count;
            f.block_idx = blockIdx;
            alive -= f.done;
            ran = true;
        }
        if (!ran)
            fail("deadlock: no barrier completed: every thread left waits at a __syncthreads or "
                 "warp collective that others of its block or warp never reach");
    }
    g_current = nullptr;
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
