// emu_main.cpp -- checks cuda/dcr_kernels.cu, run on the CPU through emu.h,
// against a serial reference: every word width, chunk sizes that do and do
// not divide the tile, unaligned pointers, one-pass overflow, both diff
// strategies, apply xor/overwrite with uniform chunks and chunk_starts, and
// the out-of-range error flag. Build: g++ -std=c++20 -O1 -pthread
// -DDCR_KERNELS='"path/to/dcr_kernels.cu"' emu_main.cpp. Exit 0 = all passed.
#include "emu.h"
#include DCR_KERNELS

#include <string>

static int failures = 0;
static int parallel_blocks = 4;
#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            ++failures;                                    \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                  \
            fprintf(stderr, "\n");                         \
            return;                                        \
        }                                                  \
    } while (0)

static u64 rng_state = 0x9e3779b97f4a7c15ull;
static u64 rnd() {
    u64 z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

template <int W>
struct Case {
    typedef typename DcrWord<W>::T T;
    u64 n, chunk;
    double frac;
    bool misalign;
    T *old_, *new_;
    std::vector<u64> chg;  // changed indices
    std::vector<i64> counts;

    void make() {
        size_t off = misalign ? W : 0;
        old_ = (T*)gmalloc(n * W, off);
        new_ = (T*)gmalloc(n * W, off);
        for (u64 i = 0; i < n; ++i) {
            old_[i] = (T)rnd();
            new_[i] = old_[i];
            if ((rnd() % 1000000) < frac * 1000000) new_[i] = (T)(old_[i] ^ (T)(rnd() | 1));
        }
        u64 nchunks = (n + chunk - 1) / chunk;
        counts.assign(nchunks, 0);
        for (u64 i = 0; i < n; ++i)
            if (old_[i] != new_[i]) {
                chg.push_back(i);
                counts[i / chunk]++;
            }
    }
};

template <int W>
static void run_diff(Case<W>& c, bool onepass, u64 cap, bool update, const char* tag) {
    typedef typename DcrWord<W>::T T;
    const u64 TW = DCR_TILE_BYTES / W;
    const u64 ntiles = (c.n + TW - 1) / TW;
    const u64 nchunks = c.counts.size();
    const u64 total = c.chg.size();
    int aligned = (((uintptr_t)c.old_ | (uintptr_t)c.new_) % 16) == 0;
    // the baseline is updated in place: work on a copy
    T* old_ = (T*)gmalloc(c.n * W, c.misalign ? W : 0);
    memcpy(old_, c.old_, c.n * W);
    u64* counts = (u64*)gmalloc(nchunks * 8);
    u64 slots = onepass ? cap : total;
    u32* pos = (u32*)gmalloc(slots * 4 + 4);
    T* val = (T*)gmalloc(slots * W + W);
    T* nv = (T*)gmalloc(slots * W + W);
    bool ok;
    if (onepass) {
        u64* ws = (u64*)gmalloc((1 + ntiles) * 8);
        ok = emu_launch(ntiles, DCR_BLOCK, parallel_blocks, [&] {
            const char* nm = "";
            (void)nm;
            if (W == 1) dcr_diff_onepass_w1(old_, c.new_, c.n, c.chunk, aligned, ws, counts, cap, pos, val, nv, update);
            if (W == 2) dcr_diff_onepass_w2(old_, c.new_, c.n, c.chunk, aligned, ws, counts, cap, pos, val, nv, update);
            if (W == 4) dcr_diff_onepass_w4(old_, c.new_, c.n, c.chunk, aligned, ws, counts, cap, pos, val, nv, update);
            if (W == 8) dcr_diff_onepass_w8(old_, c.new_, c.n, c.chunk, aligned, ws, counts, cap, pos, val, nv, update);
        });
        CHECK(ok, "%s: a block crashed", tag);
        CHECK(ws[0] == ntiles, "%s: %llu tickets for %llu tiles", tag, ws[0], ntiles);
        u64 last = ws[ntiles];
        CHECK((last >> 62) == 2 && (last & DCR_VALUE_MASK) == total, "%s: last tile status %llx, total %llu", tag, last, total);
    } else {
        i64* tc = (i64*)gmalloc(ntiles * 8);
        ok = emu_launch(ntiles, DCR_BLOCK, parallel_blocks, [&] {
            if (W == 1) dcr_diff_count_w1(old_, c.new_, c.n, c.chunk, aligned, tc, counts);
            if (W == 2) dcr_diff_count_w2(old_, c.new_, c.n, c.chunk, aligned, tc, counts);
            if (W == 4) dcr_diff_count_w4(old_, c.new_, c.n, c.chunk, aligned, tc, counts);
            if (W == 8) dcr_diff_count_w8(old_, c.new_, c.n, c.chunk, aligned, tc, counts);
        });
        CHECK(ok, "%s: a count block crashed", tag);
        i64* offs = (i64*)gmalloc(ntiles * 8);
        i64 run = 0;
        for (u64 t = 0; t < ntiles; ++t) {
            offs[t] = run;
            run += tc[t];
        }
        CHECK((u64)run == total, "%s: tile counts sum %lld, want %llu", tag, run, total);
        ok = emu_launch(ntiles, DCR_BLOCK, parallel_blocks, [&] {
            if (W == 1) dcr_diff_compact_w1(old_, c.new_, c.n, c.chunk, aligned, offs, total, pos, val, nv, update);
            if (W == 2) dcr_diff_compact_w2(old_, c.new_, c.n, c.chunk, aligned, offs, total, pos, val, nv, update);
            if (W == 4) dcr_diff_compact_w4(old_, c.new_, c.n, c.chunk, aligned, offs, total, pos, val, nv, update);
            if (W == 8) dcr_diff_compact_w8(old_, c.new_, c.n, c.chunk, aligned, offs, total, pos, val, nv, update);
        });
        CHECK(ok, "%s: a compact block crashed", tag);
    }
    for (u64 ch = 0; ch < nchunks; ++ch)
        CHECK((i64)counts[ch] == c.counts[ch], "%s: chunk %llu count %llu, want %lld", tag, ch, counts[ch], c.counts[ch]);
    u64 written = total < slots ? total : slots;
    for (u64 k = 0; k < written; ++k) {
        u64 i = c.chg[k];
        CHECK(pos[k] == (u32)(i % c.chunk), "%s: entry %llu position %u, want %llu", tag, k, pos[k], i % c.chunk);
        CHECK(val[k] == (T)(c.old_[i] ^ c.new_[i]), "%s: entry %llu xor differs", tag, k);
        CHECK(nv[k] == c.new_[i], "%s: entry %llu new value differs", tag, k);
    }
    CHECK(pos[slots] == 0, "%s: wrote past the capacity", tag);
    for (u64 i = 0, k = 0; i < c.n; ++i) {
        bool is_chg = k < total && c.chg[k] == i;
        T want = (update && is_chg && k < written) ? c.new_[i] : c.old_[i];
        CHECK(old_[i] == want, "%s: baseline word %llu wrong (changed=%d, rank %llu)", tag, i, (int)is_chg, k);
        if (is_chg) ++k;
    }
}

template <int W>
static void run_apply(Case<W>& c, bool xor_, bool starts_mode, const char* tag) {
    typedef typename DcrWord<W>::T T;
    const u64 nchunks = c.counts.size();
    const u64 total = c.chg.size();
    u64 gap = starts_mode ? 5 : 0;  // chunks placed into a bigger target with gaps
    u64 n_target = c.n + gap * nchunks;
    T* target = (T*)gmalloc(n_target * W);
    i64* starts = starts_mode ? (i64*)gmalloc(nchunks * 8) : nullptr;
    for (u64 ch = 0; ch < nchunks; ++ch)
        if (starts) starts[ch] = ch * (c.chunk + gap);
    auto tidx = [&](u64 i) { return starts_mode ? (i / c.chunk) * (c.chunk + gap) + i % c.chunk : i; };
    for (u64 i = 0; i < c.n; ++i) target[tidx(i)] = c.old_[i];
    i64* incl = (i64*)gmalloc(nchunks * 8);
    i64 run = 0;
    for (u64 ch = 0; ch < nchunks; ++ch) incl[ch] = (run += c.counts[ch]);
    u32* pos = (u32*)gmalloc(total * 4 + 4);
    T* val = (T*)gmalloc(total * W + W);
    for (u64 k = 0; k < total; ++k) {
        u64 i = c.chg[k];
        pos[k] = (u32)(i % c.chunk);
        val[k] = xor_ ? (T)(c.old_[i] ^ c.new_[i]) : c.new_[i];
    }
    u32* err = (u32*)gmalloc(4);
    const u64 E = DCR_BLOCK * DCR_APPLY_PER_THREAD;
    u64 grid = (total + E - 1) / E;
    u64 chunk_arg = starts_mode ? 0 : c.chunk;
    bool ok = emu_launch(grid, DCR_BLOCK, parallel_blocks, [&] {
#define DCR_APPLY_CALL(w) \
    if (W == w) { if (xor_) dcr_apply_xor_w##w(target, n_target, chunk_arg, starts, incl, nchunks, pos, val, total, err); \
                  else dcr_apply_overwrite_w##w(target, n_target, chunk_arg, starts, incl, nchunks, pos, val, total, err); }
        DCR_APPLY_CALL(1) DCR_APPLY_CALL(2) DCR_APPLY_CALL(4) DCR_APPLY_CALL(8)
    });
    CHECK(ok, "%s: an apply block crashed", tag);
    CHECK(*err == 0, "%s: error flag set", tag);
    for (u64 i = 0; i < c.n; ++i) CHECK(target[tidx(i)] == c.new_[i], "%s: target word %llu wrong", tag, i);
    for (u64 ch = 0; starts_mode && ch < nchunks; ++ch)
        for (u64 g = 0; g < gap; ++g) {
            u64 ix = ch * (c.chunk + gap) + c.chunk + g;
            if (ix < n_target) CHECK(target[ix] == 0, "%s: gap word %llu written", tag, ix);
        }
    // out-of-range entries set the error flag and are skipped
    if (total >= 2) {
        u32 saved = pos[total - 1];
        pos[total - 1] = starts_mode ? 0xFFFFFFFFu : (u32)c.chunk;  // past its chunk / the target
        *err = 0;
        T before = target[tidx(c.chg[total - 1])];
        ok = emu_launch(grid, DCR_BLOCK, parallel_blocks, [&] {
            DCR_APPLY_CALL(1) DCR_APPLY_CALL(2) DCR_APPLY_CALL(4) DCR_APPLY_CALL(8)
        });
        CHECK(ok && *err == 1, "%s: bad position not flagged (err=%u)", tag, *err);
        CHECK(target[tidx(c.chg[total - 1])] == before, "%s: bad entry wrote", tag);
        pos[total - 1] = saved;
    }
}

template <int W>
static void run_width() {
    const u64 TW = DCR_TILE_BYTES / W;
    struct Spec {
        u64 n, chunk;
        double frac;
        bool misalign;
    } specs[] = {
        {1, 1, 1.0, false},
        {1000, 64, 0.05, false},
        {TW * 3, TW, 0.03, false},              // chunks = tiles
        {TW * 2 + 77, 4097, 0.04, true},        // unaligned, chunk boundaries inside tiles
        {TW * 9 + 5, TW * 4 + 3, 0.02, false},  // many tiles per chunk, look-back windows
        {TW * 2, 7, 0.3, false},                // many chunks per tile (per-word chunk counts)
        {3000, 1u << 20, 0.0, false},           // nothing changed
        {TW + 1, 100, 1.0, false},              // everything changed
    };
    for (auto& s : specs) {
        gfree_all();
        Case<W> c{s.n, s.chunk, s.frac, s.misalign};
        c.make();
        char tag[160];
        u64 total = c.chg.size();
        for (int update = 0; update < 2; ++update) {
            snprintf(tag, sizeof tag, "w%d n=%llu chunk=%llu frac=%g%s update=%d", W, s.n, s.chunk, s.frac,
                     s.misalign ? " misaligned" : "", update);
            std::string t(tag);
            run_diff<W>(c, false, 0, update, (t + " twopass").c_str());
            run_diff<W>(c, true, total, update, (t + " onepass exact").c_str());
            run_diff<W>(c, true, total + 100, update, (t + " onepass roomy").c_str());
            if (total > 2) run_diff<W>(c, true, total / 3, update, (t + " onepass overflow").c_str());
            run_diff<W>(c, true, 0, update, (t + " onepass cap0").c_str());
        }
        snprintf(tag, sizeof tag, "w%d n=%llu chunk=%llu frac=%g", W, s.n, s.chunk, s.frac);
        std::string t(tag);
        run_apply<W>(c, true, false, (t + " apply_xor").c_str());
        run_apply<W>(c, false, false, (t + " apply_overwrite").c_str());
        run_apply<W>(c, true, true, (t + " apply_xor starts").c_str());
        run_apply<W>(c, false, true, (t + " apply_overwrite starts").c_str());
        printf("ok %s (%llu changed)\n", tag, total);
        fflush(stdout);
    }
}

int main(int argc, char** argv) {
    if (argc > 1) parallel_blocks = atoi(argv[1]);
    run_width<1>();
    run_width<2>();
    run_width<4>();
    run_width<8>();
    printf("%s: %d failures\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
