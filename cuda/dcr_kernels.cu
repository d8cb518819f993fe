// dcr_kernels.cu -- CUDA kernels for dcr's sparse XOR delta codec.
//
// Plain CUDA C++ for NVRTC: no host code, no #include, every entry point is
// `extern "C"` with a `_w{1,2,4,8}` suffix naming the word width in bytes
// (bool/fp8/int8 = 1, bf16/fp16/int16 = 2, fp32/int32 = 4, fp64/int64 = 8).
// All data is handled as unsigned integer words, so NaN payloads, -0.0 and
// subnormals are compared and moved bit for bit.
//
// Sparse layout (the codec's): the flat tensor is cut into chunks of `chunk`
// elements; for each chunk in order, a contiguous run of entries
// (position within the chunk as uint32, word), positions ascending. Entry k of
// the whole diff is therefore the k-th changed element in global index order,
// so a single global rank gives every entry's slot.
//
// Diff, two ways:
//  * two-pass: dcr_diff_count (per-tile change counts + per-chunk counts),
//    an exclusive scan of the tile counts on the host side (torch.cumsum),
//    then dcr_diff_compact (recompute masks, rank, scatter).
//  * one-pass: dcr_diff_onepass, a single pass with a decoupled look-back
//    (tiles take tickets in order, publish their aggregate, and a warp sums
//    predecessors' aggregates until it meets an inclusive prefix).
// Ranking inside a tile: per-thread 16-byte vectors, a per-vector bit mask of
// changed words (popc gives counts, popc of the lower bits gives the rank
// inside the vector), and one block-wide exclusive scan of a packed 64-bit
// value holding the DCR_VECS per-vector counts in 16-bit fields.
//
// Apply: dcr_apply_xor (target[start(c) + pos] ^= val) and
// dcr_apply_overwrite (target[start(c) + pos] = val); the chunk of entry k is
// found by binary search in the inclusive scan of the per-chunk counts.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define DCR_BLOCK 256
#define DCR_WARPS (DCR_BLOCK / 32)
/* Tuning knobs, set with -D by the loader (part of the cache key):
   DCR_VECS: 16-byte vectors per thread per tile (1, 2 or 4; the per-vector
   counts are packed into 16-bit fields of one 64-bit scan value), so a tile
   is DCR_BLOCK * DCR_VECS * 16 bytes of each input (16 KiB by default).
   DCR_MIN_BLOCKS: __launch_bounds__ min blocks per SM for the diff kernels
   (0 = not given, the compiler's choice; 3 = at most 80 registers a thread,
   3 blocks of 256 threads per SM, no spills on sm_90 with DCR_VECS 4). */
#ifndef DCR_VECS
#define DCR_VECS 4
#endif
#ifndef DCR_MIN_BLOCKS
#define DCR_MIN_BLOCKS 3
#endif
#if DCR_MIN_BLOCKS > 0
#define DCR_DIFF_BOUNDS __launch_bounds__(DCR_BLOCK, DCR_MIN_BLOCKS)
#else
#define DCR_DIFF_BOUNDS __launch_bounds__(DCR_BLOCK)
#endif
#if DCR_VECS != 1 && DCR_VECS != 2 && DCR_VECS != 4
#error "DCR_VECS must be 1, 2 or 4"
#endif
#define DCR_TILE_BYTES (DCR_BLOCK * DCR_VECS * 16)
#define DCR_APPLY_PER_THREAD 4
#define DCR_FULL 0xffffffffu

#define DCR_MAX_SPINS (1u << 26) /* look-back polls before giving up (~a minute) */
#define DCR_FLAG_AGG (1ull << 62)
#define DCR_FLAG_PREFIX (2ull << 62)
#define DCR_VALUE_MASK ((1ull << 62) - 1ull)

template <int W> struct DcrWord;
template <> struct DcrWord<1> { typedef u8 T; };
template <> struct DcrWord<2> { typedef u16 T; };
template <> struct DcrWord<4> { typedef u32 T; };
template <> struct DcrWord<8> { typedef u64 T; };

template <int W> union DcrVec {
    uint4 v;
    typename DcrWord<W>::T w[16 / W];
};

static __device__ __forceinline__ u64 dcr_warp_sum(u64 v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(DCR_FULL, v, off);
    return v;
}

static __device__ __forceinline__ u64 dcr_ld_volatile(const u64* p) {
    return *((const volatile u64*)p);
}

static __device__ __forceinline__ void dcr_st_volatile(u64* p, u64 v) {
    *((volatile u64*)p) = v;
}

// Exclusive block scan of a 64-bit value; *total gets the block sum.
// s_warp must hold DCR_WARPS entries. Contains __syncthreads().
static __device__ __forceinline__ u64 dcr_block_excl_scan(u64 x, u64* total, u64* s_warp) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    u64 inc = x;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        u64 y = __shfl_up_sync(DCR_FULL, inc, off);
        if (lane >= off) inc += y;
    }
    if (lane == 31) s_warp[warp] = inc;
    __syncthreads();
    u64 before = 0, all = 0;
#pragma unroll
    for (int w = 0; w < DCR_WARPS; ++w) {
        u64 s = s_warp[w];
        if (w < warp) before += s;
        all += s;
    }
    *total = all;
    return before + inc - x;
}

// Field j (16 bits) of a packed count.
static __device__ __forceinline__ u64 dcr_field(u64 packed, int j) {
    return (packed >> (16 * j)) & 0xffffull;
}

// Word v of a 16-byte vector held as uint4 (v is a compile-time constant
// after unrolling, so this is a shift and a mask on one register; keeping the
// data as 4 x 32-bit registers instead of an array of words keeps the
// register count, and with it occupancy, in check).
static __device__ __forceinline__ u32 dcr_comp(const uint4& a, int c) {
    return c == 0 ? a.x : c == 1 ? a.y : c == 2 ? a.z : a.w;
}
template <int W>
static __device__ __forceinline__ typename DcrWord<W>::T dcr_word(const uint4& a, int v) {
    typedef typename DcrWord<W>::T T;
    if (W == 8) return (T)(((u64)dcr_comp(a, 2 * v + 1) << 32) | (u64)dcr_comp(a, 2 * v));
    if (W == 4) return (T)dcr_comp(a, v);
    const int per = 4 / W;
    return (T)(dcr_comp(a, v / per) >> (8 * W * (v % per)));
}
static __device__ __forceinline__ uint4 dcr_xor4(const uint4& a, const uint4& b) {
    uint4 r;
    r.x = a.x ^ b.x;
    r.y = a.y ^ b.y;
    r.z = a.z ^ b.z;
    r.w = a.w ^ b.w;
    return r;
}

// Load vector j of this thread's share of the tile (striped: vector j of
// thread t starts at word tile_start + (j * DCR_BLOCK + t) * VEC).
template <int W>
static __device__ __forceinline__ uint4 dcr_load_vec(const typename DcrWord<W>::T* p, u64 base, u64 n,
                                                     bool vector_ok) {
    typedef typename DcrWord<W>::T T;
    const int VEC = 16 / W;
    if (vector_ok) return *reinterpret_cast<const uint4*>(p + base);
    DcrVec<W> out;
#pragma unroll
    for (int v = 0; v < VEC; ++v) out.w[v] = (base + v < n) ? p[base + v] : (T)0;
    return out.v;
}

// PHASE 0: count (two-pass, pass 1). PHASE 1: compact with given tile
// offsets (two-pass, pass 2). PHASE 2: one pass with decoupled look-back.
template <int W, int PHASE>
static __device__ __forceinline__ void dcr_diff_tile(
    typename DcrWord<W>::T* old_, const typename DcrWord<W>::T* new_, u64 n, u64 chunk, int aligned,
    i64* tile_counts, const i64* tile_offsets, u64* workspace, u64* chunk_counts, u64 cap,
    u32* positions, typename DcrWord<W>::T* values, typename DcrWord<W>::T* new_values, int update_baseline) {
    typedef typename DcrWord<W>::T T;
    const int VEC = 16 / W;
    const u64 TW = (u64)DCR_TILE_BYTES / W; /* words per tile */
    __shared__ u64 s_warp[DCR_WARPS];
    __shared__ u64 s_tile;
    __shared__ u64 s_excl;
    __shared__ u64 s_cnt0;
    __shared__ u32 s_spins;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;

    if (PHASE == 2) {
        if (tid == 0) s_tile = atomicAdd(&workspace[0], 1ull); /* ticket: tiles in start order */
        if (tid == 0) {
            s_cnt0 = 0;
            s_spins = 0;
        }
        __syncthreads();
    } else {
        if (tid == 0) {
            s_tile = blockIdx.x;
            s_cnt0 = 0;
        }
        __syncthreads();
    }
    const u64 tile = s_tile;
    const u64 tile_start = tile * TW;
    const bool full = aligned && (tile_start + TW <= n);

    uint4 x[DCR_VECS], nw[DCR_VECS]; /* old ^ new, new */
#pragma unroll
    for (int j = 0; j < DCR_VECS; ++j) {
        const u64 base = tile_start + (u64)(j * DCR_BLOCK + tid) * VEC;
        const bool vok = full || (aligned && base + VEC <= n);
        x[j] = dcr_load_vec<W>(old_, base, n, vok);
        nw[j] = dcr_load_vec<W>(new_, base, n, vok);
    }

    u32 flags[DCR_VECS];
    u64 packed = 0;
#pragma unroll
    for (int j = 0; j < DCR_VECS; ++j) {
        x[j] = dcr_xor4(x[j], nw[j]);
        u32 f = 0;
#pragma unroll
        for (int v = 0; v < VEC; ++v) f |= (dcr_word<W>(x[j], v) != 0 ? 1u : 0u) << v;
        flags[j] = f;
        packed |= (u64)__popc(f) << (16 * j);
    }

    // chunk of the tile's first element, and where that chunk ends
    const u64 c0 = tile_start / chunk;
    const u64 c0_start = c0 * chunk;
    const u64 c0_end = c0_start + chunk;

    // per-chunk counts (pass 1 / one pass): elements of chunk c0 are counted
    // block-wide, the rare ones past a chunk boundary go straight to global.
    if (PHASE != 1) {
        u64 mine0 = 0;
#pragma unroll
        for (int j = 0; j < DCR_VECS; ++j) {
            u32 f = flags[j];
            const u64 base = tile_start + (u64)(j * DCR_BLOCK + tid) * VEC;
            if (base + VEC <= c0_end) {
                mine0 += __popc(f);
            } else {
                while (f) {
                    const int v = __ffs(f) - 1;
                    f &= f - 1;
                    const u64 i = base + v;
                    if (i < c0_end) ++mine0;
                    else atomicAdd(&chunk_counts[i / chunk], 1ull);
                }
            }
        }
        mine0 = dcr_warp_sum(mine0);
        if (lane == 0 && mine0) atomicAdd(&s_cnt0, mine0);
    }

    u64 total_packed;
    const u64 excl_packed = dcr_block_excl_scan(packed, &total_packed, s_warp);
    u64 agg = 0;
#pragma unroll
    for (int j = 0; j < DCR_VECS; ++j) agg += dcr_field(total_packed, j);

    if (PHASE != 1) {
        /* s_cnt0 is complete: dcr_block_excl_scan synchronised the block */
        if (tid == 0 && s_cnt0) atomicAdd(&chunk_counts[c0], s_cnt0);
    }
    if (PHASE == 0) {
        if (tid == 0) tile_counts[tile] = (i64)agg;
        return;
    }

    if (PHASE == 1) {
        if (tid == 0) s_excl = (u64)tile_offsets[tile];
    } else if (warp == 0) {
        u64* status = workspace + 1;
        u64 excl = 0;
        if (tile == 0) {
            if (lane == 0) dcr_st_volatile(&status[0], DCR_FLAG_PREFIX | agg);
        } else {
            if (lane == 0) dcr_st_volatile(&status[tile], DCR_FLAG_AGG | agg);
            int pred = (int)tile - 1 - lane; /* grids have < 2^31 blocks */
            while (true) {
                u64 s;
                do {
                    s = (pred >= 0) ? dcr_ld_volatile(&status[pred]) : DCR_FLAG_PREFIX;
                    /* predecessors only need to finish their own reduction;
                       waiting this long means a bug: fail loudly, don't hang */
                    if (lane == 0 && ++s_spins > DCR_MAX_SPINS) __trap(); /* counter in smem: no register */
                } while (__any_sync(DCR_FULL, (s >> 62) == 0));
                const u32 pm = __ballot_sync(DCR_FULL, (s >> 62) == 2);
                const int first = pm ? (__ffs(pm) - 1) : 31;
                const u64 mine = (lane <= first) ? (s & DCR_VALUE_MASK) : 0ull;
                excl += dcr_warp_sum(mine);
                if (pm) break;
                pred -= 32;
            }
            if (lane == 0) dcr_st_volatile(&status[tile], DCR_FLAG_PREFIX | (excl + agg));
        }
        if (lane == 0) s_excl = excl;
    }
    __syncthreads();
    const u64 tile_excl = s_excl;
    if (tile_excl >= cap) return; /* nothing of this tile fits (overflow run) */

    u64 before_j = 0; /* changed words of the tile in vectors j' < j (all threads) */
#pragma unroll
    for (int j = 0; j < DCR_VECS; ++j) {
        u32 f = flags[j];
        const u64 base = tile_start + (u64)(j * DCR_BLOCK + tid) * VEC;
        u64 k = tile_excl + before_j + dcr_field(excl_packed, j);
        before_j += dcr_field(total_packed, j);
        if (f == 0) continue;
        /* Baseline update: one 16-byte store of the new vector (unchanged
           words get their own bits back) when every changed word of the
           vector has a slot; otherwise word by word for the slots k < cap,
           so an overflowing one-pass run updates exactly its written entries. */
        bool vec_updated = false;
        if (update_baseline && (full || (aligned && base + VEC <= n)) && k + (u64)__popc(f) <= cap) {
            *reinterpret_cast<uint4*>(old_ + base) = nw[j];
            vec_updated = true;
        }
        /* one iteration per changed word; dcr_word with a run-time v is a
           few selects and a shift, no local memory */
        while (f) {
            const int v = __ffs(f) - 1;
            f &= f - 1;
            if (k < cap) {
                const u64 i = base + v;
                const u64 start = (i < c0_end) ? c0_start : (i / chunk) * chunk;
                positions[k] = (u32)(i - start);
                if (values) values[k] = dcr_word<W>(x[j], v);
                if (new_values) new_values[k] = dcr_word<W>(nw[j], v);
                if (update_baseline && !vec_updated) old_[i] = dcr_word<W>(nw[j], v);
            }
            ++k;
        }
    }
}

// First c in [lo, hi] with incl[c] > k (incl: inclusive scan of counts).
static __device__ __forceinline__ u64 dcr_upper_bound(const i64* incl, u64 lo, u64 hi, u64 k) {
    while (lo < hi) {
        const u64 mid = lo + ((hi - lo) >> 1);
        if ((u64)incl[mid] > k) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

template <int W, bool XOR>
static __device__ __forceinline__ void dcr_apply(
    typename DcrWord<W>::T* target, u64 n_target, u64 chunk, const i64* chunk_starts, const i64* incl,
    u64 nchunks, const u32* positions, const typename DcrWord<W>::T* values, u64 total, u32* error) {
    const u64 E = (u64)DCR_BLOCK * DCR_APPLY_PER_THREAD;
    __shared__ u64 s_lo, s_hi;
    const u64 k0 = (u64)blockIdx.x * E;
    if (k0 >= total) return;
    const u64 k1 = (k0 + E < total ? k0 + E : total) - 1;
    if (threadIdx.x == 0) {
        s_lo = dcr_upper_bound(incl, 0, nchunks - 1, k0);
        s_hi = dcr_upper_bound(incl, s_lo, nchunks - 1, k1);
    }
    __syncthreads();
    const u64 lo = s_lo, hi = s_hi;
    u32 bad = 0;
#pragma unroll
    for (int j = 0; j < DCR_APPLY_PER_THREAD; ++j) {
        const u64 k = k0 + (u64)j * DCR_BLOCK + threadIdx.x;
        if (k > k1) break;
        const u64 c = (lo == hi) ? lo : dcr_upper_bound(incl, lo, hi, k);
        const u64 pos = positions[k];
        const u64 start = chunk_starts ? (u64)chunk_starts[c] : c * chunk;
        const u64 i = start + pos;
        if (i < n_target && (chunk == 0 || pos < chunk)) {
            if (XOR) target[i] ^= values[k];
            else target[i] = values[k];
        } else {
            bad = 1;
        }
    }
    if (bad) atomicOr(error, 1u);
}

#define DCR_INSTANTIATE(W)                                                                                \
    extern "C" __global__ void DCR_DIFF_BOUNDS dcr_diff_count_w##W(                         \
        const void* old_, const void* new_, u64 n, u64 chunk, int aligned, i64* tile_counts,             \
        u64* chunk_counts) {                                                                              \
        dcr_diff_tile<W, 0>((DcrWord<W>::T*)old_, (const DcrWord<W>::T*)new_, n, chunk, aligned,         \
                            tile_counts, 0, 0, chunk_counts, 0, 0, 0, 0, 0);                              \
    }                                                                                                     \
    extern "C" __global__ void DCR_DIFF_BOUNDS dcr_diff_compact_w##W(                       \
        void* old_, const void* new_, u64 n, u64 chunk, int aligned, const i64* tile_offsets, u64 cap,   \
        u32* positions, void* values, void* new_values, int update_baseline) {                            \
        dcr_diff_tile<W, 1>((DcrWord<W>::T*)old_, (const DcrWord<W>::T*)new_, n, chunk, aligned, 0,      \
                            tile_offsets, 0, 0, cap, positions, (DcrWord<W>::T*)values,                   \
                            (DcrWord<W>::T*)new_values, update_baseline);                                 \
    }                                                                                                     \
    extern "C" __global__ void DCR_DIFF_BOUNDS dcr_diff_onepass_w##W(                       \
        void* old_, const void* new_, u64 n, u64 chunk, int aligned, u64* workspace, u64* chunk_counts,  \
        u64 cap, u32* positions, void* values, void* new_values, int update_baseline) {                   \
        dcr_diff_tile<W, 2>((DcrWord<W>::T*)old_, (const DcrWord<W>::T*)new_, n, chunk, aligned, 0, 0,   \
                            workspace, chunk_counts, cap, positions, (DcrWord<W>::T*)values,              \
                            (DcrWord<W>::T*)new_values, update_baseline);                                 \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(DCR_BLOCK) dcr_apply_xor_w##W(                          \
        void* target, u64 n_target, u64 chunk, const i64* chunk_starts, const i64* incl, u64 nchunks,    \
        const u32* positions, const void* values, u64 total, u32* error) {                                \
        dcr_apply<W, true>((DcrWord<W>::T*)target, n_target, chunk, chunk_starts, incl, nchunks,         \
                           positions, (const DcrWord<W>::T*)values, total, error);                        \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(DCR_BLOCK) dcr_apply_overwrite_w##W(                    \
        void* target, u64 n_target, u64 chunk, const i64* chunk_starts, const i64* incl, u64 nchunks,    \
        const u32* positions, const void* values, u64 total, u32* error) {                                \
        dcr_apply<W, false>((DcrWord<W>::T*)target, n_target, chunk, chunk_starts, incl, nchunks,        \
                            positions, (const DcrWord<W>::T*)values, total, error);                       \
    }

DCR_INSTANTIATE(1)
DCR_INSTANTIATE(2)
DCR_INSTANTIATE(4)
DCR_INSTANTIATE(8)
