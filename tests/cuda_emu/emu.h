// emu.h -- run cuda/dcr_kernels.cu on the CPU, for logic tests without a GPU.
//
// Each CUDA thread is a std::thread; a block runs in its own fork()ed
// process, so `__shared__` (mapped to function-local `static`) is private to
// the block while "global memory" lives in a MAP_SHARED arena that all block
// processes see. Several blocks run at once, so the one-pass kernel's
// decoupled look-back really waits on other blocks. Warp intrinsics are
// emulated with a 32-thread barrier and an exchange array; they require all
// 32 lanes to call them together, which the kernels do (full masks only).
// This checks the algorithm (ranking, scan, look-back, chunk bookkeeping,
// apply bounds), not GPU timing, the memory model or code generation.
#pragma once
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sys/mman.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
struct EmuDim3 {
    unsigned int x = 0, y = 0, z = 0;
};
inline thread_local EmuDim3 threadIdx;
inline EmuDim3 blockIdx;

struct EmuWarp {
    std::barrier<>* bar;
    unsigned long long xch[32];
};
inline std::barrier<>* emu_block_bar;
inline EmuWarp* emu_warps;

inline void __syncthreads() { emu_block_bar->arrive_and_wait(); }
[[noreturn]] inline void __trap() {
    fprintf(stderr, "__trap() in block %u thread %u\n", blockIdx.x, threadIdx.x);
    abort();
}
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __ffs(unsigned int x) { return __builtin_ffs((int)x); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned int atomicOr(unsigned int* p, unsigned int v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }

template <class T>
inline T emu_exchange(T v, unsigned src) {
    EmuWarp& w = emu_warps[threadIdx.x >> 5];
    w.xch[threadIdx.x & 31] = (unsigned long long)v;
    w.bar->arrive_and_wait();
    T r = (T)w.xch[src];
    w.bar->arrive_and_wait();
    return r;
}
template <class T>
inline T __shfl_up_sync(unsigned, T v, int off) {
    unsigned lane = threadIdx.x & 31;
    return emu_exchange(v, lane >= (unsigned)off ? lane - off : lane);
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int off) {
    return emu_exchange(v, (threadIdx.x & 31) ^ (unsigned)off);
}
inline unsigned __ballot_sync(unsigned, int pred) {
    EmuWarp& w = emu_warps[threadIdx.x >> 5];
    w.xch[threadIdx.x & 31] = pred ? 1 : 0;
    w.bar->arrive_and_wait();
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= (unsigned)(w.xch[i] & 1) << i;
    w.bar->arrive_and_wait();
    return r;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }

// ---- "global memory": a shared anonymous mapping, bump-allocated
inline char* emu_arena = nullptr;
inline size_t emu_arena_size = 0, emu_arena_used = 0;
inline void* gmalloc(size_t bytes, size_t misalign = 0) {
    if (!emu_arena) {
        emu_arena_size = size_t(1) << 31;
        emu_arena = (char*)mmap(nullptr, emu_arena_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (emu_arena == MAP_FAILED) { perror("mmap"); exit(3); }
    }
    size_t off = (emu_arena_used + 255) & ~size_t(255);
    if (off + bytes + misalign + 256 > emu_arena_size) { fprintf(stderr, "arena full\n"); exit(3); }
    emu_arena_used = off + bytes + misalign;
    memset(emu_arena + off, 0, bytes + misalign);
    return emu_arena + off + misalign;
}
inline void gfree_all() { emu_arena_used = 0; }

// Run `grid` blocks of `block` threads, up to `parallel` blocks at a time,
// each block in a child process. Returns false if a block crashed.
inline bool emu_launch(unsigned grid, unsigned block, int parallel, const std::function<void()>& body) {
    std::vector<pid_t> live;
    bool ok = true;
    auto reap = [&](bool all) {
        while (!live.empty() && (all || (int)live.size() >= parallel)) {
            int st = 0;
            pid_t p = wait(&st);
            if (p < 0) break;
            for (size_t i = 0; i < live.size(); ++i)
                if (live[i] == p) { live.erase(live.begin() + i); break; }
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = false;
        }
    };
    fflush(stdout);
    fflush(stderr);
    for (unsigned b = 0; b < grid; ++b) {
        reap(false);
        pid_t pid = fork();
        if (pid < 0) { perror("fork"); exit(3); }
        if (pid == 0) {
            blockIdx.x = b;
            std::barrier<> bbar(block);
            emu_block_bar = &bbar;
            unsigned nw = (block + 31) / 32;
            std::vector<EmuWarp> warps(nw);
            for (unsigned w = 0; w < nw; ++w) warps[w].bar = new std::barrier<>(32);
            emu_warps = warps.data();
            std::vector<std::thread> ts;
            ts.reserve(block);
            for (unsigned t = 0; t < block; ++t)
                ts.emplace_back([t, &body] {
                    threadIdx.x = t;
                    body();
                });
            for (auto& t : ts) t.join();
            _exit(0);
        }
        live.push_back(pid);
    }
    reap(true);
    return ok;
}

// Run `grid` blocks one after another in this process (threads for CUDA
// threads). For memory the caller owns (e.g. torch CPU tensors), which forked
// block processes could not write back; blocks never overlap, so the
// one-pass look-back always finds its predecessor finished.
inline bool emu_launch_inprocess(unsigned grid, unsigned block, const std::function<void()>& body) {
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx.x = b;
        std::barrier<> bbar(block);
        emu_block_bar = &bbar;
        unsigned nw = (block + 31) / 32;
        std::vector<EmuWarp> warps(nw);
        for (unsigned w = 0; w < nw; ++w) warps[w].bar = new std::barrier<>(32);
        emu_warps = warps.data();
        std::vector<std::thread> ts;
        ts.reserve(block);
        for (unsigned t = 0; t < block; ++t)
            ts.emplace_back([t, &body] {
                threadIdx.x = t;
                body();
            });
        for (auto& t : ts) t.join();
        for (auto& w : warps) delete w.bar;
    }
    return true;
}
