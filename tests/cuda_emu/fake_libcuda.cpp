// fake_libcuda.cpp -- the slice of the CUDA driver API that dcr.cuda._driver
// uses, backed by the CPU emulation of cuda/dcr_kernels.cu (emu.h). "Device
// pointers" are host pointers (torch CPU tensors), kernels run block after
// block in this process. Lets tests drive the real Python launch path --
// argument packing, kernel names, SIGNATURES order, sizes, capacity overflow
// -- without a GPU. Build: g++ -std=c++20 -O1 -pthread -shared -fPIC
// -DDCR_KERNELS='"path/to/dcr_kernels.cu"' fake_libcuda.cpp -o libfakecuda.so
// and point $DCR_LIBCUDA at it.
#include "emu.h"
#include DCR_KERNELS

#include <string>

namespace {
struct Entry {
    const char* name;
    std::function<std::function<void()>(void**)> bind;  // kernel params -> thread body
};
#define A(i, T) (*reinterpret_cast<T*>(p[i]))
#define DCR_FAKE_ENTRIES(W)                                                                                  \
    Entry{"dcr_diff_count_w" #W,                                                                             \
          [](void** p) -> std::function<void()> {                                                            \
              auto a0 = A(0, const void*); auto a1 = A(1, const void*); auto a2 = A(2, u64);               \
              auto a3 = A(3, u64); auto a4 = A(4, int); auto a5 = A(5, i64*); auto a6 = A(6, u64*);        \
              return [=] { dcr_diff_count_w##W(a0, a1, a2, a3, a4, a5, a6); };                               \
          }},                                                                                                \
    Entry{"dcr_diff_compact_w" #W,                                                                           \
          [](void** p) -> std::function<void()> {                                                            \
              auto a0 = A(0, void*); auto a1 = A(1, const void*); auto a2 = A(2, u64); auto a3 = A(3, u64); \
              auto a4 = A(4, int); auto a5 = A(5, const i64*); auto a6 = A(6, u64); auto a7 = A(7, u32*);  \
              auto a8 = A(8, void*); auto a9 = A(9, void*); auto a10 = A(10, int);                         \
              return [=] { dcr_diff_compact_w##W(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10); };            \
          }},                                                                                                \
    Entry{"dcr_diff_onepass_w" #W,                                                                           \
          [](void** p) -> std::function<void()> {                                                            \
              auto a0 = A(0, void*); auto a1 = A(1, const void*); auto a2 = A(2, u64); auto a3 = A(3, u64); \
              auto a4 = A(4, int); auto a5 = A(5, u64*); auto a6 = A(6, u64*); auto a7 = A(7, u64);        \
              auto a8 = A(8, u32*); auto a9 = A(9, void*); auto a10 = A(10, void*); auto a11 = A(11, int); \
              return [=] { dcr_diff_onepass_w##W(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11); };       \
          }},                                                                                                \
    Entry{"dcr_apply_xor_w" #W,                                                                              \
          [](void** p) -> std::function<void()> {                                                            \
              auto a0 = A(0, void*); auto a1 = A(1, u64); auto a2 = A(2, u64); auto a3 = A(3, const i64*); \
              auto a4 = A(4, const i64*); auto a5 = A(5, u64); auto a6 = A(6, const u32*);                 \
              auto a7 = A(7, const void*); auto a8 = A(8, u64); auto a9 = A(9, u32*);                      \
              return [=] { dcr_apply_xor_w##W(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9); };                    \
          }},                                                                                                \
    Entry{"dcr_apply_overwrite_w" #W, [](void** p) -> std::function<void()> {                               \
              auto a0 = A(0, void*); auto a1 = A(1, u64); auto a2 = A(2, u64); auto a3 = A(3, const i64*); \
              auto a4 = A(4, const i64*); auto a5 = A(5, u64); auto a6 = A(6, const u32*);                 \
              auto a7 = A(7, const void*); auto a8 = A(8, u64); auto a9 = A(9, u32*);                      \
              return [=] { dcr_apply_overwrite_w##W(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9); };              \
          }}

const Entry kEntries[] = {DCR_FAKE_ENTRIES(1), DCR_FAKE_ENTRIES(2), DCR_FAKE_ENTRIES(4), DCR_FAKE_ENTRIES(8)};
const int kCount = sizeof(kEntries) / sizeof(kEntries[0]);
thread_local void* g_current_ctx = nullptr;
char g_ctx_token, g_module_token;
unsigned long long g_launches = 0;
}  // namespace

extern "C" {
int cuInit(unsigned) { return 0; }
int cuGetErrorString(int rc, const char** s) {
    *s = rc == 500 ? "CUDA_ERROR_NOT_FOUND (fake)" : "fake driver error";
    return 0;
}
int cuDeviceGet(int* dev, int ordinal) {
    if (ordinal != 0) return 101;  // CUDA_ERROR_INVALID_DEVICE
    *dev = 0;
    return 0;
}
int cuDevicePrimaryCtxRetain(void** ctx, int) {
    *ctx = &g_ctx_token;
    return 0;
}
int cuCtxGetCurrent(void** ctx) {
    *ctx = g_current_ctx;
    return 0;
}
int cuCtxSetCurrent(void* ctx) {
    g_current_ctx = ctx;
    return 0;
}
int cuModuleLoadData(void** mod, const void* image) {
    if (!image) return 1;
    *mod = &g_module_token;
    return 0;
}
int cuModuleGetFunction(void** f, void* mod, const char* name) {
    if (mod != &g_module_token) return 400;  // CUDA_ERROR_INVALID_HANDLE
    for (int i = 0; i < kCount; ++i)
        if (std::string(kEntries[i].name) == name) {
            *f = (void*)(uintptr_t)(i + 1);
            return 0;
        }
    return 500;
}
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shmem, void* stream, void** params, void** extra) {
    (void)stream;
    uintptr_t i = (uintptr_t)f;
    if (g_current_ctx != &g_ctx_token) return 201;  // CUDA_ERROR_INVALID_CONTEXT
    if (i < 1 || i > (uintptr_t)kCount || !params || extra) return 1;
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || shmem != 0 || bx != DCR_BLOCK || gx == 0) return 1;
    auto body = kEntries[i - 1].bind(params);
    ++g_launches;
    return emu_launch_inprocess(gx, bx, body) ? 0 : 1;
}
unsigned long long fake_cuda_launches() { return g_launches; }
}
