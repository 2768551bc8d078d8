// dsv41 EXL3 kernels for decode/verify windows (m <= 16 rows): fused matmul and routed-expert MoE.
//
// Format: ../../../../../shared/spec/EXL3-ENGRAM.md §1-2 (a 16x16 tile is 8K uint32 words, MSB-first stream,
// 16-bit tail-biting windows, tensor-core permutation). Stream positions 8l..8l+7 of a tile belong to lane l and
// are exactly that lane's share of one 16x16 mma operand, so every lane decodes its 8 weights from 2-4 words and
// feeds them to the tensor core without any shared-memory shuffle:
//   the weight tile goes in as the A operand of mma.m16n8k16 (A = W^T: 16 output columns x 16 inputs), and
//   up to 8 input rows go in as the B operand (16 inputs x 8 rows); a second mma covers rows 8..15.
//
// Compiled once per (K, codebook) with -DEXL3_K=<1..8> -DEXL3_CB=<0 3inst | 1 mcg | 2 mul1>; no headers, so NVRTC
// and nvcc both take it as is. Only sm_80 instructions (mma.sync, cp.async, dp4a, f16x2 arithmetic): the same
// source runs on Hopper (sm_90) and GB10 (sm_121).
//
// Row invariance: a row's result comes from its own B column of each mma (the tensor core computes every output
// element from its own row and column), the k order of accumulation is fixed by the matrix shape, and split-K
// partials are summed in split order by whichever block arrives last. So a row's bits depend neither on the other
// rows nor on m, and repeated launches are bitwise identical (no float atomics).

typedef unsigned int u32;
typedef unsigned short u16;

#ifndef EXL3_K
#error "compile with -DEXL3_K=<bits per weight>"
#endif
#ifndef EXL3_CB
#error "compile with -DEXL3_CB=<0|1|2>"
#endif

#define K EXL3_K
#define CB EXL3_CB
#define TW (8 * K)                          // words per 16x16 tile
#define WARPS 8                             // warp w owns tile column w of a 128-column block
#define NTHREADS (WARPS * 32)
#ifndef EXL3_STAGES
#define EXL3_STAGES 3
#endif
#define KR 8                                // tile rows per pipeline stage: one 128-deep block
#define STAGES EXL3_STAGES                  // stages in the cp.async ring
// EXL3_ABLATE=1 skips the decode arithmetic (raw words as operands), 2 skips the main loop, 3 skips the split-K
// reduction (each block writes its own partial as the result): wrong results, only for bench/exl3_ablation.py.
#ifndef EXL3_ABLATE
#define EXL3_ABLATE 0
#endif
// Blocks per SM the register budget must allow (launch bounds): without it ptxas squeezes the kernels to 48
// registers by recomputing the lanes' loop-invariant offsets in the k loop (more instructions per tile);
// 4 x 256 threads leaves 64 registers, enough to keep them (docs/perf/exl3.md, "Numbers behind the code").
#ifndef EXL3_MIN_BLOCKS
#define EXL3_MIN_BLOCKS 4
#endif
#define MIN_BLOCKS EXL3_MIN_BLOCKS
// Blocks per SM the routed-expert MoE kernels' register budget allows (bench/exl3_moe_splits.py --tuning).
#ifndef EXL3_MOE_MIN_BLOCKS
#define EXL3_MOE_MIN_BLOCKS EXL3_MIN_BLOCKS
#endif
// The same linear kernel for launches of at most 2 blocks per SM (wq_b: 256 blocks): a register budget for 2
// blocks (up to 128 registers) lets ptxas keep more of the loop's state and loads in flight.
#ifndef EXL3_FEW_MIN_BLOCKS
#define EXL3_FEW_MIN_BLOCKS 2
#endif
// Split partials the larger-register kernel loads per L2 round trip in the split-K reduction (sum_partials).
#ifndef EXL3_SUM_BATCH
#define EXL3_SUM_BATCH 8
#endif
// One-row launches of the larger-register kernel decode their first stage while the input loads (0: in the loop).
#ifndef EXL3_PREDECODE
#define EXL3_PREDECODE 1
#endif
// Units (row, 128-block) per warp up to which exl3_linear_few_rows_r8 (2..8 rows, larger register budget) rotates
// its input by warp (rotate_by_warp; the other kernels: 2, more spill there). 12 covers wq_b's 8 rows x 10 blocks
// and wo_b's 8 x 11.
#ifndef EXL3_WARP_UNITS
#define EXL3_WARP_UNITS 12
#endif
// The same for exl3_linear_rows_r8 (2..8 rows, 4 blocks per SM; the host takes it only where the units fit, e.g.
// the head's 2 x 14).
#ifndef EXL3_ROWS_WARP_UNITS
#define EXL3_ROWS_WARP_UNITS 4
#endif
// MoE blocks whose units fit 2 per warp (every block of an expert that one token picked) rotate their input by warp
// like the linear's one-row launches: no block barrier between the loads and the rotation (docs/perf/exl3.md,
// "Numbers behind the code"). 0 for A/B runs.
#ifndef EXL3_MOE_ONE_ROW
#define EXL3_MOE_ONE_ROW 1
#endif
#define ROW_WORDS (8 * TW)                  // one tile row of a 128-column block (contiguous in memory)
#define STAGE_WORDS (KR * ROW_WORDS)
#define NA ((7 * K + 16 + 31) / 32)         // words holding a lane's 7K+16 stream bits once re-aligned to bit 0
#define NW_SPAN ((31 + 7 * K + 16 + 31) / 32)
#define NW (NW_SPAN > NA + 1 ? NW_SPAN : NA + 1)  // words a lane reads per tile (its bits start at any offset)
#define YS_STRIDE 132                        // fp32 row stride of the epilogue tile (128 + 4 against bank conflicts)
#define INV_SQRT128 0.08838834764831845f
#define SMEM_INTS 128

// ------------------------------------------------------------------------------------------------------------
// small PTX helpers (no cuda_fp16.h: the same text compiles under NVRTC without include paths)
// ------------------------------------------------------------------------------------------------------------

__device__ __forceinline__ u32 shf_l(u32 lo, u32 hi, u32 s) {
    // upper 32 bits of (hi:lo) << s
    u32 d;
    asm("shf.l.wrap.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(s));
    return d;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("{.reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t;}" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 float_to_half(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u16 float_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{.reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t;}" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_stages() { asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2)); }

__device__ __forceinline__ void mma_16816(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90+, also GB10): a kernel may start while the previous one in the stream
// drains; it must wait before reading anything that kernel wrote (activations, routing, workspaces). Weights are
// never written by kernels, so their prefetch goes before the wait. Both are no-ops without the launch attribute.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_kernel_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Thread block clusters (sm_90+, also GB10): the k splits of one column block can form a cluster and sum their
// partials through distributed shared memory instead of global memory and an arrival counter.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// 4 floats at `local` (a shared-memory address of this block) in the cluster block of rank `rank`.
__device__ __forceinline__ float4 load_cluster4(const float* local, u32 rank) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote));
#endif
    return v;
}

// ------------------------------------------------------------------------------------------------------------
// decode: a lane's 8 consecutive stream positions -> the 4 f16x2 registers of its A fragment
// ------------------------------------------------------------------------------------------------------------

// Two codebook values packed as f16x2 (first state in the low half).
__device__ __forceinline__ u32 codebook_pair(u32 s0, u32 s1) {
#if CB == 2
    // MUL1: dp4a sums the 4 bytes of s*0x83DCD12D into the mantissa of fp16 1024 (0x6400); one f16x2 FMA then
    // applies *fp16(0x1EEE) + fp16(0xC931) with a single rounding, as the reference kernel does (§2.1).
    u32 h0, h1, v;
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(h0) : "r"(s0 * 0x83DCD12Du), "r"(0x01010101u), "r"(0x6400u));
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(h1) : "r"(s1 * 0x83DCD12Du), "r"(0x01010101u), "r"(0x6400u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(v) : "r"(prmt(h0, h1, 0x5410u)), "r"(0x1EEE1EEEu), "r"(0xC931C931u));
    return v;
#else
#if CB == 0
    u32 x0 = s0 * 89226354u + 64248484u, x1 = s1 * 89226354u + 64248484u;   // 3INST
#else
    u32 x0 = s0 * 0xCBAC1FEDu, x1 = s1 * 0xCBAC1FEDu;                         // MCG
#endif
    x0 = (x0 & 0x8FFF8FFFu) ^ 0x3B603B60u;
    x1 = (x1 & 0x8FFF8FFFu) ^ 0x3B603B60u;
    // value = fp16(low half) + fp16(high half), one fp16 addition per state: add the lows to the highs pairwise.
    u32 v;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(v) : "r"(prmt(x0, x1, 0x5410u)), "r"(prmt(x0, x1, 0x7632u)));
    return v;
#endif
}

// State j of the lane = bits [jK, jK + 16) of its re-aligned stream a[] (MSB first); offsets are compile-time.
template <int J>
__device__ __forceinline__ u32 state_at(const u32* a) {
    constexpr int o = J * K, q = o >> 5, r = o & 31;
    if constexpr (r + 16 <= 32) return (a[q] >> (16 - r)) & 0xFFFFu;
    else return shf_l(a[q + 1], a[q], r) >> 16;
}

// w[]: this lane's NW words of the tile (tile[off[i]]); sh: its bit offset.
__device__ __forceinline__ void decode_words(const u32* w, u32 sh, u32* frag) {
#if EXL3_ABLATE == 1
    frag[0] = w[0]; frag[1] = w[1]; frag[2] = w[0] ^ sh; frag[3] = w[1] ^ sh;
    return;
#endif
    u32 a[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) a[i] = shf_l(w[i + 1], w[i], sh);
    // Stream position j of lane (g, t) is element (k = 2t + (j&1) + 8((j>>1)&1), n = g + 8(j>>2)) of the tile;
    // A fragment registers hold (n=g, k=2t..+1), (n=g+8, k=2t..+1), (n=g, k=2t+8..+9), (n=g+8, k=2t+8..+9).
    frag[0] = codebook_pair(state_at<0>(a), state_at<1>(a));
    frag[1] = codebook_pair(state_at<4>(a), state_at<5>(a));
    frag[2] = codebook_pair(state_at<2>(a), state_at<3>(a));
    frag[3] = codebook_pair(state_at<6>(a), state_at<7>(a));
}

// tile: the tile's first word in shared memory; off[]: this lane's word indices; sh: its bit offset.
__device__ __forceinline__ void decode_tile(const u32* tile, const int* off, u32 sh, u32* frag) {
    u32 w[NW];
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = tile[off[i]];
    decode_words(w, sh, frag);
}

__device__ __forceinline__ void lane_offsets(int lane, int* off, u32* sh) {
    // The lane's windows end at bits (8l+1)K .. (8l+8)K; the first one starts 16 bits before (tail-biting ring).
    const int start = (8 * lane * K + K - 16 + 256 * K) % (256 * K);
    const int i0 = start >> 5;
#pragma unroll
    for (int i = 0; i < NW; ++i) off[i] = (i0 + i) % TW;
    *sh = (u32)(start & 31);
}

// ------------------------------------------------------------------------------------------------------------
// 128-point Hadamard across a warp: lane holds elements 4*lane .. 4*lane+3 of one row, fp32
// ------------------------------------------------------------------------------------------------------------

__device__ __forceinline__ void hadamard128(float* v, int lane) {
    float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    v[0] = a0 + a2; v[2] = a0 - a2; v[1] = a1 + a3; v[3] = a1 - a3;
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
        const bool upper = (lane & s) != 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float o = __shfl_xor_sync(0xffffffffu, v[e], s);
            v[e] = upper ? o - v[e] : v[e] + o;
        }
    }
}

// Elements i..i+3 (i a multiple of 4, the row 16-byte aligned: checked on the host) rounded to fp16 first, as
// ExLlamaV3 takes fp16 activations (dtype 0 fp16, 1 bf16, 2 fp32).
// Elements i..i+3 of a row as stored (fp16/bf16: 8 bytes in .x/.y; fp32: 16 bytes); the loads of all rows are
// issued before any is used, so a block waits for one global load, not one per row.
__device__ __forceinline__ uint4 load4_raw(const void* p, long long i, int dtype) {
    if (dtype == 2) return *(const uint4*)((const float*)p + i);
    const uint2 h = *(const uint2*)((const u16*)p + i);
    return make_uint4(h.x, h.y, 0u, 0u);
}

// The 4 elements rounded to fp16 first, as ExLlamaV3 takes fp16 activations (dtype 0 fp16, 1 bf16, 2 fp32).
__device__ __forceinline__ void raw4_as_half(uint4 r, int dtype, float* v) {
    if (dtype == 2) {
        const u32 f[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = half_to_float(float_to_half(__uint_as_float(f[e])));
        return;
    }
    const u32 w[2] = {r.x, r.y};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const u16 bits = (u16)(e & 1 ? w[e >> 1] >> 16 : w[e >> 1] & 0xFFFFu);
        v[e] = dtype == 0 ? half_to_float(bits) : half_to_float(float_to_half(__uint_as_float((u32)bits << 16)));
    }
}

__device__ __forceinline__ float load_value(const void* p, long long i, int dtype) {
    if (dtype == 2) return ((const float*)p)[i];
    const u16 bits = ((const u16*)p)[i];
    return dtype == 0 ? half_to_float(bits) : __uint_as_float((u32)bits << 16);
}

__device__ __forceinline__ void store_value(void* p, long long i, int dtype, float v) {
    if (dtype == 2) ((float*)p)[i] = v;
    else if (dtype == 0) ((u16*)p)[i] = float_to_half(v);
    else ((u16*)p)[i] = float_to_bf16(v);
}

// Where rotate_input stores word w (= fp16 pair) of a row's 128-block, so that the main loop reads a lane's B
// operand words for all 8 tile rows of the block as four 16-byte chunks: word w = 8r + 4h + t holds inputs
// 16r + 2t + 8h (and +1) of tile row r, which lane (g, t) passes as b_h; chunk q (words 16q + 4t .. +3) holds
// tile rows 2q and 2q+1 as (h=0, h=1, h=0, h=1). With a row stride of 16 words (mod 32) the 8 lanes of each
// quarter warp read 8 distinct 16-byte bank groups.
__device__ __forceinline__ int b_word_pos(int w) {
    const int r = w >> 3, h = (w >> 2) & 1, t = w & 3;
    return 16 * (r >> 1) + 4 * t + 2 * (r & 1) + h;
}

// 4 fp16 values packed in two words, as floats.
__device__ __forceinline__ void halves_to_float(uint2 h, float* v) {
    v[0] = half_to_float((u16)(h.x & 0xFFFFu)); v[1] = half_to_float((u16)(h.x >> 16));
    v[2] = half_to_float((u16)(h.y & 0xFFFFu)); v[3] = half_to_float((u16)(h.y >> 16));
}

// A lane's 4 rotated values (elements 4l..4l+3 of a 128-block, before the 1/sqrt(128)) into the block in
// b_word_pos order, as fp16.
__device__ __forceinline__ void store_rotated(u32* blk, const float* v, int lane) {
    blk[b_word_pos(2 * lane)] = (u32)float_to_half(v[0] * INV_SQRT128) | ((u32)float_to_half(v[1] * INV_SQRT128) << 16);
    blk[b_word_pos(2 * lane + 1)] = (u32)float_to_half(v[2] * INV_SQRT128) | ((u32)float_to_half(v[3] * INV_SQRT128) << 16);
}

// xh[row, kk] = fp16( H/sqrt(128) · fp16(x[src, k0 + kk] * suh[k0 + kk]) ) per 128 block, for the block's
// `rows` real rows (the main loop's lanes of later rows read row rows-1 instead: their outputs are never stored),
// each 128-block stored in the b_word_pos order. src[row] < 0 marks a padding row (zeros). Two phases so that no
// warp waits on global loads one after another: all threads load and scale (independent loads), then one warp per
// (row, 128-block) rotates from shared memory.
template <int ROWS>
__device__ __forceinline__ void rotate_input(u16* xs, int xs_stride, int rows, const void* x, int ldx,
                                             int x_dtype, const int* src, const u16* suh, int k0, int nkb, int warp,
                                             int lane) {
    const int width = nkb * 128;
    // suh is a weight: the first column groups' scales are read before waiting for the previous kernel
    constexpr int EARLY = 2;
    uint2 su_early[EARLY];
#pragma unroll
    for (int i = 0; i < EARLY; ++i) {
        const int cg = threadIdx.x + i * NTHREADS;
        su_early[i] = cg < width / 4 ? *(const uint2*)(suh + k0 + 4 * cg) : make_uint2(0u, 0u);
    }
    wait_for_previous_kernel();
#pragma unroll 1
    for (int cg = threadIdx.x, i = 0; cg < width / 4; cg += NTHREADS, ++i) {
        const int col = 4 * cg;
        // 4 fp16 scales, read once for all rows
        float su[4];
        halves_to_float(i == 0 ? su_early[0] : i == 1 ? su_early[1] : *(const uint2*)(suh + k0 + col), su);
        // 8 rows at a time: their loads in flight together (16-bit inputs: 2 registers per row; fp32: 4)
#pragma unroll
        for (int r0 = 0; r0 < ROWS; r0 += 8) {
            if (r0 >= rows) break;
            uint4 raw[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const int row = r0 + q;
                raw[q] = make_uint4(0u, 0u, 0u, 0u);
                if (row < rows && src[row] >= 0) raw[q] = load4_raw(x, (long long)src[row] * ldx + k0 + col, x_dtype);
            }
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const int row = r0 + q;
                if (row >= rows) break;
                uint2 packed = make_uint2(0u, 0u);
                if (src[row] >= 0) {
                    float v[4];
                    raw4_as_half(raw[q], x_dtype, v);
                    // exact fp16 x fp16 product, rounded once to fp16 (the reference's fp16 multiply)
                    packed.x = (u32)float_to_half(v[0] * su[0]) | ((u32)float_to_half(v[1] * su[1]) << 16);
                    packed.y = (u32)float_to_half(v[2] * su[2]) | ((u32)float_to_half(v[3] * su[3]) << 16);
                }
                *(uint2*)(xs + row * xs_stride + col) = packed;
            }
        }
    }
    __syncthreads();
    for (int unit = warp; unit < rows * nkb; unit += WARPS) {
        const int row = unit / nkb, kb = unit - row * nkb;
        if (src[row] < 0) continue;  // zeros in any order
        u32* blk = (u32*)(xs + row * xs_stride + kb * 128);
        const u32 p0 = blk[2 * lane], p1 = blk[2 * lane + 1];
        float v[4] = {half_to_float((u16)(p0 & 0xFFFFu)), half_to_float((u16)(p0 >> 16)),
                      half_to_float((u16)(p1 & 0xFFFFu)), half_to_float((u16)(p1 >> 16))};
        hadamard128(v, lane);
        __syncwarp();  // every lane has read the block before any lane writes its permuted words
        store_rotated(blk, v, lane);
    }
}

// std::conditional without <type_traits> (the source compiles under NVRTC without include paths)
template <bool B, typename T, typename E>
struct Pick { using type = T; };
template <typename T, typename E>
struct Pick<false, T, E> { using type = E; };

// rotate_input for launches of at most MAXU x WARPS "units" (row, 128-block of the slice), unit u = row u / nkb,
// block u % nkb: warp w rotates units w, w + WARPS, ..., and its lane l loads exactly the 4 inputs 4l..4l+3 that
// it rotates, so the values stay in registers: no block barrier or shared-memory round trip between the loads and
// the rotation, and all of a warp's loads are in flight together. `meanwhile` runs between issuing the loads and
// using them. WIDE: any input dtype (room for fp32's 16 bytes per lane and unit), else fp16/bf16 only (8). Same
// arithmetic as rotate_input, so the same bits.
template <int MAXU, bool WIDE, typename F>
__device__ __forceinline__ void rotate_by_warp(u16* xs, int xs_stride, int rows, const void* x, int ldx, int x_dtype,
                                               const int* src, const u16* suh, int k0, int nkb, int warp, int lane,
                                               F&& meanwhile) {
    const int units = rows * nkb;
    // unit warp + i * WARPS is (row0 + i * step_row + carries, ...): one division each, not one per unit
    const int row0 = warp / nkb, step_row = WARPS / nkb, step_kb = WARPS - step_row * nkb;
    int row_of[MAXU], kb_of[MAXU];
    uint2 su2[MAXU];
    using Raw = typename Pick<WIDE, uint4, uint2>::type;
    Raw raw[MAXU];
#pragma unroll
    for (int i = 0, row = row0, kb = warp - row0 * nkb; i < MAXU; ++i) {
        row_of[i] = row;
        kb_of[i] = kb;
        su2[i] = warp + i * WARPS < units ? *(const uint2*)(suh + k0 + kb * 128 + 4 * lane) : make_uint2(0u, 0u);
        row += step_row;
        kb += step_kb;
        if (kb >= nkb) { kb -= nkb; ++row; }
    }
    wait_for_previous_kernel();
#pragma unroll
    for (int i = 0; i < MAXU; ++i) {
        const int from = warp + i * WARPS < units ? src[row_of[i]] : -1;
        const long long at = (long long)from * ldx + k0 + kb_of[i] * 128 + 4 * lane;
        if constexpr (WIDE) raw[i] = from >= 0 ? load4_raw(x, at, x_dtype) : make_uint4(0u, 0u, 0u, 0u);
        else raw[i] = from >= 0 ? *(const uint2*)((const u16*)x + at) : make_uint2(0u, 0u);
    }
    meanwhile();
#pragma unroll
    for (int i = 0; i < MAXU; ++i) {
        if (warp + i * WARPS >= units) break;  // warp-uniform
        float su[4], v[4];
        halves_to_float(su2[i], su);
        if constexpr (WIDE) raw4_as_half(raw[i], x_dtype, v);
        else raw4_as_half(make_uint4(raw[i].x, raw[i].y, 0u, 0u), x_dtype, v);
        // padding rows (src < 0) load zeros: their rotation is zeros, as rotate_input writes them
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = half_to_float(float_to_half(v[e] * su[e]));
        hadamard128(v, lane);
        store_rotated((u32*)(xs + row_of[i] * xs_stride + kb_of[i] * 128), v, lane);
    }
}

// The input rotation of a block: by warp where the launch's units fit (up to 2 per warp any input dtype; up to MAXU
// fp16/bf16 only, as fp32 loads take twice the registers), else rotate_input. Returns whether it went by warp, the
// only case in which `meanwhile` runs.
template <int ROWS, int MAXU, typename F>
__device__ __forceinline__ bool rotate_slice(u16* xs, int xs_stride, int rows, const void* x, int ldx, int x_dtype,
                                             const int* src, const u16* suh, int k0, int nkb, int warp, int lane,
                                             F&& meanwhile) {
    const int units = rows * nkb;
    if (units <= 2 * WARPS) {
        // its own instance: one-row launches ran slower through the MAXU-unit one (docs/perf/exl3.md)
        rotate_by_warp<2, true>(xs, xs_stride, rows, x, ldx, x_dtype, src, suh, k0, nkb, warp, lane, meanwhile);
        return true;
    }
    if constexpr (MAXU > 2) {
        if (x_dtype != 2 && units <= MAXU * WARPS) {
            rotate_by_warp<MAXU, false>(xs, xs_stride, rows, x, ldx, x_dtype, src, suh, k0, nkb, warp, lane,
                                        meanwhile);
            return true;
        }
    }
    rotate_input<ROWS>(xs, xs_stride, rows, x, ldx, x_dtype, src, suh, k0, nkb, warp, lane);
    return false;
}

// ------------------------------------------------------------------------------------------------------------
// the main loop: one block = 128 output columns x a k slice x up to ROWS input rows
// ------------------------------------------------------------------------------------------------------------

struct Smem {
    u32* stages;   // [WARPS][STAGES][KR][TW] one cp.async ring per warp
    float* ys;     // [ROWS][YS_STRIDE] fp32 block result (epilogue)
    int* ints;     // [SMEM_INTS]: 0..15 source row per block row, 16..31 MoE slot per block row, 32 flag,
                   // 64..71 per-warp counts
    u16* xs;       // [rows][xs_stride] rotated input, fp16 (last: the host sizes it for the rows a launch can have)
};

template <int ROWS>
__device__ __forceinline__ Smem carve(void* base) {
    Smem s;
    s.stages = (u32*)base;
    s.ys = (float*)(s.stages + STAGES * STAGE_WORDS);
    s.ints = (int*)(s.ys + ROWS * YS_STRIDE);
    s.xs = (u16*)(s.ints + SMEM_INTS);
    return s;
}

// Each warp streams its own tile column through its own STAGES-deep ring (no block-wide barrier in the k loop):
// ring[STAGES][KR][TW] words at stages + warp * STAGES * KR * TW. A stage is one 128-deep block (KR = 8 tile rows).
#define RING_WORDS (STAGES * KR * TW)
static_assert(STAGES >= 2 && STAGES <= 4, "pipeline_prologue unrolls up to 3 prefetched stages");
#define CHUNKS_PER_TILE (TW / 4)                       // 16-byte cp.async chunks per tile
#define STAGE_CHUNKS (KR * CHUNKS_PER_TILE)
#define LANE_CHUNKS ((STAGE_CHUNKS + 31) / 32)          // chunks per lane and stage

// The cp.async work of one lane: chunk j of every stage is tile row r, words w..w+3 (fixed per lane).
struct StageCopy {
    const u32* src[LANE_CHUNKS];  // global source of the next stage to load
    u32 dst[LANE_CHUNKS];         // shared address in slot 0 of the ring
    long long step;               // words from one stage to the next (KR tile rows)
};

__device__ __forceinline__ StageCopy stage_copy(const u32* ring, const u32* tile_col, long long row_stride_words,
                                                int first_stage, int lane) {
    StageCopy c;
    c.step = KR * row_stride_words;
#pragma unroll
    for (int j = 0; j < LANE_CHUNKS; ++j) {
        const int ch = min(lane + 32 * j, STAGE_CHUNKS - 1);  // lanes past the end are masked in issue()
        const int r = ch / CHUNKS_PER_TILE, w = (ch - r * CHUNKS_PER_TILE) * 4;
        c.src[j] = tile_col + (first_stage * KR + r) * row_stride_words + w;
        c.dst[j] = smem_addr(ring + r * TW + w);
    }
    return c;
}

// Issues this lane's chunks of the next stage into ring slot SLOT and moves the sources on by one stage.
template <int SLOT>
__device__ __forceinline__ void issue_stage(StageCopy& c, bool load, int lane) {
#pragma unroll
    for (int j = 0; j < LANE_CHUNKS; ++j) {
        if (load && (STAGE_CHUNKS % 32 == 0 || j + 1 < LANE_CHUNKS || lane + 32 * j < STAGE_CHUNKS))
            cp_async16(c.dst[j] + SLOT * KR * TW * 4, c.src[j]);
        c.src[j] += c.step;
    }
}

// The first STAGES-1 stages of the warp's tiles (weights only: may run before wait_for_previous_kernel).
__device__ __forceinline__ void pipeline_prologue(const Smem& sm, const u32* tile_col, long long row_stride_words,
                                                  int n_stages, int warp, int lane) {
    StageCopy c = stage_copy(sm.stages + warp * RING_WORDS, tile_col, row_stride_words, 0, lane);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        switch (s) {  // the slot is a compile-time constant of issue_stage
            case 0: issue_stage<0>(c, s < n_stages, lane); break;
            case 1: issue_stage<1>(c, s < n_stages, lane); break;
            case 2: issue_stage<2>(c, s < n_stages, lane); break;
            default: issue_stage<3>(c, s < n_stages, lane); break;
        }
        cp_async_commit();
    }
}

// B operands of tile rows 0..7 of k block `kb`: four 16-byte chunks per 8 input rows (see b_word_pos). Lanes of rows
// past the block's real rows read its last row instead: B column g only feeds output row g, never stored.
template <int ROWS>
__device__ __forceinline__ void load_b(uint4 (&b)[ROWS / 8][4], const Smem& sm, int xs_stride, const int* xrow, int kb,
                                       int t) {
#pragma unroll
    for (int h = 0; h < ROWS / 8; ++h) {
        const uint4* src = (const uint4*)(sm.xs + xrow[h] * xs_stride + kb * 128 + 8 * t);
#pragma unroll
        for (int q = 0; q < 4; ++q) b[h][q] = src[4 * q];
    }
}

// The products of tile row r (even rows into acc, odd into odd).
template <int ROWS>
__device__ __forceinline__ void tile_products(float* acc, float* odd, const u32* frag, const uint4 (&b)[ROWS / 8][4],
                                              int r) {
    float* a = (r & 1) ? odd : acc;
    const uint4 c0 = b[0][r >> 1];
    mma_16816(a, frag, (r & 1) ? c0.z : c0.x, (r & 1) ? c0.w : c0.y);
    if (ROWS == 16) {
        const uint4 c1 = b[ROWS / 8 - 1][r >> 1];
        mma_16816(a + 4, frag, (r & 1) ? c1.z : c1.x, (r & 1) ? c1.w : c1.y);
    }
}

// Decodes and multiplies the KR tiles of the stage in ring slot SLOT (k block `kb` of the slice).
template <int ROWS, int SLOT>
__device__ __forceinline__ void stage_product(float* acc, float* odd, const Smem& sm, const u32* ring,
                                              const int* off, u32 sh, int xs_stride, const int* xrow, int kb,
                                              int t) {
    uint4 b[ROWS / 8][4];
    load_b<ROWS>(b, sm, xs_stride, xrow, kb, t);
    const u32* stage = ring + SLOT * KR * TW;
#pragma unroll
    for (int r = 0; r < KR; ++r) {
        u32 frag[4];
        decode_tile(stage + r * TW, off, sh, frag);
        tile_products<ROWS>(acc, odd, frag, b, r);
    }
}

// The A fragments of the warp's first stage (ring slot 0), decoded before the rotated input is ready: the prologue's
// copies are waited for here instead of in the loop's first turn (main_loop with `pre`).
__device__ __forceinline__ void predecode_first_stage(u32 (&frag)[KR][4], const Smem& sm, int warp, int lane) {
    int off[NW];
    u32 sh;
    lane_offsets(lane, off, &sh);
    cp_async_wait_stages();
    __syncwarp();
    const u32* stage = sm.stages + warp * RING_WORDS;
#pragma unroll
    for (int r = 0; r < KR; ++r) decode_tile(stage + r * TW, off, sh, frag[r]);
}

// stage_product of the first stage with its fragments decoded already (same products in the same order).
template <int ROWS>
__device__ __forceinline__ void first_stage_product(float* acc, float* odd, const Smem& sm, const u32 (&frag)[KR][4],
                                                    int xs_stride, const int* xrow, int t) {
    uint4 b[ROWS / 8][4];
    load_b<ROWS>(b, sm, xs_stride, xrow, 0, t);
#pragma unroll
    for (int r = 0; r < KR; ++r) tile_products<ROWS>(acc, odd, frag[r], b, r);
}

// The per-warp state of the k loop.
template <int ROWS>
struct WarpLoop {
    float* acc;
    float* odd;
    const Smem* sm;
    const u32* ring;
    int off[NW];
    u32 sh;
    int xs_stride, n_stages, t, lane;
    int xrow[2];  // the xs row this lane reads for B columns g and g + 8
    StageCopy copy;

    // Stages base + S, base + S + 1, ... of one round through the ring (S is the ring slot).
    template <int S>
    __device__ __forceinline__ void round_from(int base) {
        if constexpr (S < STAGES) {
            const int it = base + S;
            if (it >= n_stages) return;
            cp_async_wait_stages();
            __syncwarp();  // stage `it` visible to the whole warp; the slot of stage it-1 no longer read
            issue_stage<(S + STAGES - 1) % STAGES>(copy, it + STAGES - 1 < n_stages, lane);
            cp_async_commit();
            stage_product<ROWS, S>(acc, odd, *sm, ring, off, sh, xs_stride, xrow, it, t);
            round_from<S + 1>(base);
        }
    }
};

// acc += xh[rows, kslice] @ W_q[kslice, tile column] for this warp (after pipeline_prologue and a block barrier
// that publishes the rotated input). acc[0..3]: rows 2t, 2t+1 at columns g and g+8 of the tile (mma C layout);
// acc[4..7] the same for rows 8+. Even and odd tile rows accumulate separately (two independent mma chains),
// added once at the end: a fixed order that depends on the shape only. The stage loop is unrolled by STAGES so
// that ring slots are compile-time offsets.
// (`pre`, `use_pre`: the first stage's fragments from predecode_first_stage; a flag, not a null pointer, so that the
// fragments stay in registers)
template <int ROWS, bool PRE = false>
__device__ __forceinline__ void main_loop(float* acc, const Smem& sm, int xs_stride, int rows, const u32* tile_col,
                                          long long row_stride_words, int n_stages, int warp, int lane,
                                          const u32 (&pre)[KR][4], bool use_pre) {
    float odd[ROWS / 2];
#pragma unroll
    for (int i = 0; i < ROWS / 2; ++i) odd[i] = 0.f;
    WarpLoop<ROWS> L;
    L.acc = acc;
    L.odd = odd;
    L.sm = &sm;
    L.ring = sm.stages + warp * RING_WORDS;
    lane_offsets(lane, L.off, &L.sh);
    L.xs_stride = xs_stride;
    L.n_stages = n_stages;
    L.t = lane & 3;
    L.lane = lane;
    L.xrow[0] = min(lane >> 2, rows - 1);
    L.xrow[1] = min((lane >> 2) + 8, rows - 1);
    L.copy = stage_copy(L.ring, tile_col, row_stride_words, STAGES - 1, lane);
    if (PRE && use_pre) {
        // the first turn of round_from<0>(0) without its wait and decode (predecode_first_stage did them)
        issue_stage<STAGES - 1>(L.copy, STAGES - 1 < n_stages, lane);
        cp_async_commit();
        first_stage_product<ROWS>(acc, odd, sm, pre, xs_stride, L.xrow, L.t);
        L.template round_from<1>(0);
        for (int base = STAGES; base < n_stages; base += STAGES) L.template round_from<0>(base);
    } else {
        for (int base = 0; base < n_stages; base += STAGES) L.template round_from<0>(base);
    }
    asm volatile("cp.async.wait_all;");
#pragma unroll
    for (int i = 0; i < ROWS / 2; ++i) acc[i] += odd[i];
}

template <int ROWS>
__device__ __forceinline__ void main_loop(float* acc, const Smem& sm, int xs_stride, int rows, const u32* tile_col,
                                          long long row_stride_words, int n_stages, int warp, int lane) {
    const u32 none[KR][4] = {};
    main_loop<ROWS, false>(acc, sm, xs_stride, rows, tile_col, row_stride_words, n_stages, warp, lane, none, false);
}

// The warp's accumulators into ys[row][col] (block-local columns).
template <int ROWS>
__device__ __forceinline__ void stash_acc(const float* acc, float* ys, int warp, int lane) {
    const int g = lane >> 2, t = lane & 3, c = warp * 16 + g;
#pragma unroll
    for (int h = 0; h < ROWS / 8; ++h) {
        const int r = h * 8 + 2 * t;
        ys[r * YS_STRIDE + c] = acc[4 * h + 0];
        ys[(r + 1) * YS_STRIDE + c] = acc[4 * h + 1];
        ys[r * YS_STRIDE + c + 8] = acc[4 * h + 2];
        ys[(r + 1) * YS_STRIDE + c + 8] = acc[4 * h + 3];
    }
}

// k slice of split sp out of `splits` (whole 128-blocks, as even as possible; depends only on the shape).
__device__ __forceinline__ void kslice(int k, int sp, int splits, int* kb_lo, int* nkb) {
    const int kbs = k / 128;
    *kb_lo = sp * kbs / splits;
    *nkb = (sp + 1) * kbs / splits - *kb_lo;
}

// Sum of split partials (in split order) for one row's 4 columns at `i`. Read past L1 (other SMs wrote them);
// the loads are independent, BATCH in flight at a time (8 in the kernels with the larger register budget: one L2
// round trip for up to 8 splits, two for the expert's 14; 4 in the others, where 8 spill), and the additions keep
// split order.
template <int BATCH = 4>
__device__ __forceinline__ void sum_partials(const float* part, long long split_stride, long long i, int splits,
                                             float* v) {
    v[0] = v[1] = v[2] = v[3] = 0.f;
    if constexpr (BATCH <= 4) {
        // (this shape of the loop keeps the 64-register kernels free of spills)
        int s = 0;
        for (; s + 4 <= splits; s += 4) {
            float4 q[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) q[u] = __ldcg((const float4*)(part + (s + u) * split_stride + i));
#pragma unroll
            for (int u = 0; u < 4; ++u) { v[0] += q[u].x; v[1] += q[u].y; v[2] += q[u].z; v[3] += q[u].w; }
        }
        for (; s < splits; ++s) {
            const float4 q = __ldcg((const float4*)(part + s * split_stride + i));
            v[0] += q.x; v[1] += q.y; v[2] += q.z; v[3] += q.w;
        }
    } else {
        for (int s = 0; s < splits; s += BATCH) {
            float4 q[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u)
                if (s + u < splits) q[u] = __ldcg((const float4*)(part + (s + u) * split_stride + i));
#pragma unroll
            for (int u = 0; u < BATCH; ++u)
                if (s + u < splits) { v[0] += q[u].x; v[1] += q[u].y; v[2] += q[u].z; v[3] += q[u].w; }
        }
    }
}

// Arrival ticket: true in the one block that finishes last for this counter (then the counter is reset).
__device__ __forceinline__ bool last_to_arrive(int* counter, int expected, int* shared_flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int ticket = atomicAdd(counter, 1);
        const bool last = ticket == expected - 1;
        if (last) *counter = 0;  // ready for the next launch (graph replays included)
        *shared_flag = last;
    }
    __syncthreads();
    if (*shared_flag) __threadfence();
    return *shared_flag != 0;
}

// One block's share: rows sm.ints[0..ROWS) (source row per block row, -1 = padding) of x through the k slice
// [kb_lo, kb_lo + nkb) of a 128-column block; leaves the fp32 block result (before the output rotation) in sm.ys.
template <int ROWS>
__device__ __forceinline__ void block_product(const Smem& sm, int xs_stride, int rows, const void* x, int ldx,
                                              int x_dtype, const u32* trellis, const u16* suh, int n, int cb,
                                              int kb_lo, int nkb) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long row_stride_words = (long long)(n / 16) * TW;
    const u32* tile_col = trellis + (long long)kb_lo * 8 * row_stride_words + (long long)cb * ROW_WORDS + warp * TW;
#if EXL3_ABLATE != 2
    pipeline_prologue(sm, tile_col, row_stride_words, nkb, warp, lane);
#endif
#if EXL3_MOE_ONE_ROW
    rotate_slice<ROWS, 2>(sm.xs, xs_stride, rows, x, ldx, x_dtype, sm.ints, suh, kb_lo * 128, nkb, warp, lane, [] {});
#else
    rotate_input<ROWS>(sm.xs, xs_stride, rows, x, ldx, x_dtype, sm.ints, suh, kb_lo * 128, nkb, warp, lane);
#endif
    __syncthreads();  // the rotated input is read by every warp
    float acc[ROWS / 2];
#pragma unroll
    for (int i = 0; i < ROWS / 2; ++i) acc[i] = 0.f;
#if EXL3_ABLATE != 2
    main_loop<ROWS>(acc, sm, xs_stride, rows, tile_col, row_stride_words, nkb, warp, lane);
#endif
    // the next kernel may now launch and prefetch its weights while this one reduces and writes
    let_next_kernel_start();
    stash_acc<ROWS>(acc, sm.ys, warp, lane);
    __syncthreads();
}

// Block rows [0, rows) of sm.ys -> dst[r * ld + col0 .. + 128) (fp32 partials).
__device__ __forceinline__ void store_partial(const float* ys, float* dst, long long ld, int rows) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < rows; r += WARPS) {
        const float* src = ys + r * YS_STRIDE + 4 * lane;
        *(float4*)(dst + r * ld + 4 * lane) = make_float4(src[0], src[1], src[2], src[3]);
    }
}

// This lane's 4 svh scales of a 128-column block, read when the block starts (weights: before the wait for the
// previous kernel) so that the reduction's tail does not wait on one more global load.
__device__ __forceinline__ uint2 load_svh4(const u16* svh_block, int lane) {
    return *(const uint2*)(svh_block + 4 * lane);
}

// Output rotation and svh for 4 columns of one row (v in, y out).
__device__ __forceinline__ void rotate_output(float* v, uint2 svh4, int lane) {
    hadamard128(v, lane);
    const u32 w[2] = {svh4.x, svh4.y};
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] *= INV_SQRT128 * half_to_float((u16)(e & 1 ? w[e >> 1] >> 16 : w[e >> 1] & 0xFFFFu));
}

// ------------------------------------------------------------------------------------------------------------
// fused linear: y[m, n] = x[m, k] @ W_eff
// grid (n/128, splits); partials [splits][ROWS][n] fp32; counters [n/128]
// ------------------------------------------------------------------------------------------------------------

// The split-K reduction and the epilogue of column block cb: partials in split order by the last block to arrive,
// output rotation, svh, y.
template <int ROWS, int BATCH>
__device__ __forceinline__ void finish_column_block(const Smem& sm, uint2 sv, void* y, int ldy, int y_dtype,
                                                    float* part, int* counters, int m, int n, int cb, int sp,
                                                    int splits) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long split_stride = (long long)ROWS * n;
    if (EXL3_ABLATE != 3 && splits > 1) {
        store_partial(sm.ys, part + sp * split_stride + cb * 128, n, m);
        if (!last_to_arrive(counters + cb, splits, sm.ints + 32)) return;
    }
    for (int r = warp; r < m; r += WARPS) {
        float v[4];
        if (EXL3_ABLATE != 3 && splits > 1) {
            sum_partials<BATCH>(part, split_stride, (long long)r * n + cb * 128 + 4 * lane, splits, v);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = sm.ys[r * YS_STRIDE + 4 * lane + e];
        }
        rotate_output(v, sv, lane);
#pragma unroll
        for (int e = 0; e < 4; ++e) store_value(y, (long long)r * ldy + cb * 128 + 4 * lane + e, y_dtype, v[e]);
    }
}

// Options of a linear launch (bit field): the cluster reduction; the block-wide split-K epilogue even where the
// per-warp one applies (A/B runs; the same bits).
#define OPT_CLUSTER 1
#define OPT_BLOCK_EPILOGUE 2

// Split-K epilogue of one warp, for one-row launches with one block per column block: the warp writes its
// 16 columns of the partial straight from its accumulators and counts itself in; the last of the column block's
// splits x WARPS warps sums the partials in split order, rotates and writes y. No block barrier: a warp that
// finishes its k slice early does not wait for the others (the block epilogue stashes the whole block's result
// in shared memory first). The partials are the same fp32 values, so the bits are those of finish_column_block.
// (With more rows the one last warp's row-by-row reduction costs more than the barrier saves: docs/perf/exl3.md,
// "Numbers behind the code".)
template <int BATCH>
__device__ __forceinline__ void finish_columns_by_warp(const float* acc, uint2 sv, void* y, int ldy, int y_dtype,
                                                       float* part, int* counters, int m, int n, int cb, int sp,
                                                       int splits, int warp, int lane) {
    const long long split_stride = 8LL * n;
    const int g = lane >> 2, t = lane & 3, c = cb * 128 + warp * 16 + g;
    float* dst = part + sp * split_stride;
    const int r = 2 * t;
    if (r < m) { dst[(long long)r * n + c] = acc[0]; dst[(long long)r * n + c + 8] = acc[2]; }
    if (r + 1 < m) { dst[(long long)(r + 1) * n + c] = acc[1]; dst[(long long)(r + 1) * n + c + 8] = acc[3]; }
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) {
        const int ticket = atomicAdd(counters + cb, 1);
        last = ticket == splits * WARPS - 1;
        if (last) counters[cb] = 0;  // ready for the next launch (graph replays included)
    }
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    __threadfence();
    for (int row = 0; row < m; ++row) {
        float v[4];
        sum_partials<BATCH>(part, split_stride, (long long)row * n + cb * 128 + 4 * lane, splits, v);
        rotate_output(v, sv, lane);
#pragma unroll
        for (int e = 0; e < 4; ++e) store_value(y, (long long)row * ldy + cb * 128 + 4 * lane + e, y_dtype, v[e]);
    }
}

// grid (G, splits) (or a group launch's share of its grid: cb0, sp, gx = G): block (b, sp) takes column block b of
// split sp, then (when G < n/128) further column blocks
// of split sp as they come from a per-split counter (counters[n/128 + sp]), so that blocks that finish early take
// more. G = n/128 normally; for matrices with many more blocks than fit on the GPU at once (the head) the host
// picks G so that all blocks are resident: each block then rotates its k slice of the input once for all its
// column blocks, and loads the next column block's first weight stages while it reduces the current one. Which
// block computes a column block never changes its bits.
template <int ROWS, int BATCH, bool PRE, int MAXU = 2>
__device__ __forceinline__ void linear_body(const void* x, int ldx, int x_dtype, int m, const u32* trellis,
                                            const u16* suh, const u16* svh, void* y, int ldy, int y_dtype,
                                            float* part, int* counters, int k, int n, int splits, int xs_stride,
                                            int options, int cb0, int sp, int gx) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem sm = carve<ROWS>(smem_raw);
    const int ncb = n / 128;
    const bool cluster = options & OPT_CLUSTER;
    // (uniform over the block: every warp takes the same epilogue)
    const bool warp_epilogue = ROWS == 8 && m == 1 && splits > 1 && !cluster && gx >= ncb &&
                               !(options & OPT_BLOCK_EPILOGUE);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int cb = cb0;
    int kb_lo, nkb;
    kslice(k, sp, splits, &kb_lo, &nkb);
    if (threadIdx.x < ROWS) sm.ints[threadIdx.x] = (int)threadIdx.x < m ? (int)threadIdx.x : -1;
    uint2 sv = load_svh4(svh + cb * 128, lane);
    const long long row_stride_words = (long long)(n / 16) * TW;
    // this warp's tile column of column block c is at col0 + c * ROW_WORDS
    const u32* col0 = trellis + (long long)kb_lo * 8 * row_stride_words + warp * TW;
    __syncthreads();
#if EXL3_ABLATE != 2
    pipeline_prologue(sm, col0 + (long long)cb * ROW_WORDS, row_stride_words, nkb, warp, lane);
#endif
    // the first stage's fragments, decoded while the input loads (the larger-register kernel, input rotated by warp)
    u32 pre[KR][4];
    constexpr bool PREDECODE = PRE && EXL3_ABLATE != 2;
    const bool predecoded = rotate_slice<ROWS, MAXU>(
                                sm.xs, xs_stride, m, x, ldx, x_dtype, sm.ints, suh, kb_lo * 128, nkb, warp, lane, [&] {
                                    if (PREDECODE) predecode_first_stage(pre, sm, warp, lane);
                                }) && PREDECODE;
    // (after the wait in rotate_input: the previous launch has reset the counter)
    int* const take = counters + ncb + sp;
    if (threadIdx.x == 0) sm.ints[33] = gx < ncb ? gx + atomicAdd(take, 1) : ncb;
    __syncthreads();  // the rotated input is read by every warp
    for (;;) {
        const int next = sm.ints[33];
        float acc[ROWS / 2];
#pragma unroll
        for (int i = 0; i < ROWS / 2; ++i) acc[i] = 0.f;
#if EXL3_ABLATE != 2
        main_loop<ROWS, PRE>(acc, sm, xs_stride, m, col0 + (long long)cb * ROW_WORDS, row_stride_words, nkb, warp,
                             lane, pre, predecoded && cb == cb0);
#endif
        if (next < ncb) {
            // the warp's ring is free (main_loop waited for its copies and consumed them): the next column block's
            // first stages load during this one's reduction
            __syncwarp();
#if EXL3_ABLATE != 2
            pipeline_prologue(sm, col0 + (long long)next * ROW_WORDS, row_stride_words, nkb, warp, lane);
#endif
        } else {
            // the next kernel may now launch and prefetch its weights while this one reduces and writes
            let_next_kernel_start();
        }
        if (warp_epilogue) {
            finish_columns_by_warp<BATCH>(acc, sv, y, ldy, y_dtype, part, counters, m, n, cb, sp, splits, warp, lane);
            return;
        }
        stash_acc<ROWS>(acc, sm.ys, warp, lane);
        __syncthreads();
        if (cluster && splits > 1) {
            // launched as clusters of the `splits` blocks of this column block (rank = split; G = n/128): row r
            // is finished by the block of rank r % splits, summing the blocks' partials in split order straight
            // from their shared memory; the second barrier keeps every block alive until its partial is read.
            cluster_sync();
            for (int r = sp + warp * splits; r < m; r += WARPS * splits) {
                float v[4] = {0.f, 0.f, 0.f, 0.f};
                for (int q = 0; q < splits; ++q) {
                    const float4 p = load_cluster4(sm.ys + r * YS_STRIDE + 4 * lane, (u32)q);
                    v[0] += p.x; v[1] += p.y; v[2] += p.z; v[3] += p.w;
                }
                rotate_output(v, sv, lane);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    store_value(y, (long long)r * ldy + cb * 128 + 4 * lane + e, y_dtype, v[e]);
            }
            cluster_sync();
            return;
        }
        finish_column_block<ROWS, BATCH>(sm, sv, y, ldy, y_dtype, part, counters, m, n, cb, sp, splits);
        if (next >= ncb) {
            // every block ends with one draw past the end; the last of those draws resets the counter
            if (threadIdx.x == 0 && next == ncb + gx - 1) *take = 0;
            return;
        }
        if (threadIdx.x == 0) sm.ints[33] = gx + atomicAdd(take, 1);
        __syncthreads();  // the reduction above has read ys before the next stash; the next draw is visible
        cb = next;
        sv = load_svh4(svh + cb * 128, lane);
    }
}

#define LINEAR_ARGS                                                                                          \
    const void *x, int ldx, int x_dtype, int m, const u32 *trellis, const u16 *suh, const u16 *svh, void *y, \
        int ldy, int y_dtype, float *part, int *counters, int k, int n, int splits, int xs_stride, int options
#define LINEAR_PASS                                                                                  \
    x, ldx, x_dtype, m, trellis, suh, svh, y, ldy, y_dtype, part, counters, k, n, splits, xs_stride, options, \
        (int)blockIdx.x, (int)blockIdx.y, (int)gridDim.x

extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_BLOCKS) exl3_linear_r8(LINEAR_ARGS) { linear_body<8, 4, false>(LINEAR_PASS); }
// 2..8 rows whose units fit EXL3_ROWS_WARP_UNITS per warp: the input rotated by warp (a kernel of its own, as below)
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_BLOCKS) exl3_linear_rows_r8(LINEAR_ARGS) { linear_body<8, 4, false, EXL3_ROWS_WARP_UNITS>(LINEAR_PASS); }
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_BLOCKS) exl3_linear_r16(LINEAR_ARGS) { linear_body<16, 4, false>(LINEAR_PASS); }
extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_FEW_MIN_BLOCKS) exl3_linear_few_r8(LINEAR_ARGS) { linear_body<8, EXL3_SUM_BATCH, EXL3_PREDECODE>(LINEAR_PASS); }
// 2..8 rows: the input rotated by warp up to EXL3_WARP_UNITS units per warp. Its own kernel because the code of
// that path made one-row launches slower in the kernel above (its register allocation; docs/perf/exl3.md).
extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_FEW_MIN_BLOCKS) exl3_linear_few_rows_r8(LINEAR_ARGS) { linear_body<8, EXL3_SUM_BATCH, EXL3_PREDECODE, EXL3_WARP_UNITS>(LINEAR_PASS); }
extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_FEW_MIN_BLOCKS) exl3_linear_few_r16(LINEAR_ARGS) { linear_body<16, EXL3_SUM_BATCH, EXL3_PREDECODE>(LINEAR_PASS); }

// ------------------------------------------------------------------------------------------------------------
// grouped linear: up to GROUP_MAX matrices of one K whose inputs are ready at the same point of a step (a layer's
// projections of one x; wo_a's groups; the shared expert's gate and up), <= 8 rows, in one launch. Member i owns
// the blocks [first_block, first_block + n/128 * splits) of a 1-D grid, in the (column block, split) order of its
// own launch, and its own partials and counters; each block runs linear_body on its member's arguments. So a
// member's bits are those of its own launch with the same split count, whichever members share the grid.
// ------------------------------------------------------------------------------------------------------------

#define GROUP_MAX 8

struct GroupMember {
    const void* x;
    const u32* trellis;
    const u16* suh;
    const u16* svh;
    void* y;
    float* part;
    int* counters;
    int ldx, x_dtype, ldy, y_dtype, k, n, splits, xs_stride;
    int first_block, pad0, pad1, pad2;
};

struct LinearGroup {
    GroupMember mem[GROUP_MAX];
    int count, m, options, pad;
};

// (the host's ctypes mirror, kernels/exl3/cuda.py, is checked against these sizes)
static_assert(sizeof(GroupMember) == 104, "GroupMember layout");
static_assert(sizeof(LinearGroup) == 848, "LinearGroup layout");

template <int MAXU>
__device__ __forceinline__ void group_body(const LinearGroup& g) {
    const int b = (int)blockIdx.x;
    // (unrolled with constant indices: the members stay in the parameter bank, no local-memory copy)
    int i = 0;
#pragma unroll
    for (int j = 1; j < GROUP_MAX; ++j)
        if (j < g.count && b >= g.mem[j].first_block) i = j;
    const void* x = g.mem[0].x;
    const u32* trellis = g.mem[0].trellis;
    const u16 *suh = g.mem[0].suh, *svh = g.mem[0].svh;
    void* y = g.mem[0].y;
    float* part = g.mem[0].part;
    int* counters = g.mem[0].counters;
    int ldx = g.mem[0].ldx, x_dtype = g.mem[0].x_dtype, ldy = g.mem[0].ldy, y_dtype = g.mem[0].y_dtype;
    int k = g.mem[0].k, n = g.mem[0].n, splits = g.mem[0].splits, xs_stride = g.mem[0].xs_stride;
    int first = g.mem[0].first_block;
#pragma unroll
    for (int j = 1; j < GROUP_MAX; ++j) {
        if (j == i) {
            x = g.mem[j].x; trellis = g.mem[j].trellis; suh = g.mem[j].suh; svh = g.mem[j].svh; y = g.mem[j].y;
            part = g.mem[j].part; counters = g.mem[j].counters; ldx = g.mem[j].ldx; x_dtype = g.mem[j].x_dtype;
            ldy = g.mem[j].ldy; y_dtype = g.mem[j].y_dtype; k = g.mem[j].k; n = g.mem[j].n;
            splits = g.mem[j].splits; xs_stride = g.mem[j].xs_stride; first = g.mem[j].first_block;
        }
    }
    const int ncb = n / 128, local = b - first;
    linear_body<8, EXL3_SUM_BATCH, EXL3_PREDECODE, MAXU>(x, ldx, x_dtype, g.m, trellis, suh, svh, y, ldy, y_dtype,
                                                          part, counters, k, n, splits, xs_stride, g.options,
                                                          local % ncb, local / ncb, ncb);
}

// one row (the one-row rotation), and 2..8 rows (the input rotated by warp up to EXL3_WARP_UNITS units per warp),
// with the larger register budget: a group's grid is sized to fill the GPU once at 2 blocks per SM
extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_FEW_MIN_BLOCKS) exl3_linear_group_r8(const LinearGroup g) { group_body<2>(g); }
extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_FEW_MIN_BLOCKS) exl3_linear_group_rows_r8(const LinearGroup g) { group_body<EXL3_WARP_UNITS>(g); }

// ------------------------------------------------------------------------------------------------------------
// routed-expert MoE for a window of T <= 16 tokens, top-k slots s = token * topk + i
//
// Every launch has one block row per slot; a slot's block works only if the slot is the first one (in slot order)
// that picked its expert (the expert's "leader"), and then handles all slots that picked it, in slot order.
// Nothing is read back to the host: the launch shapes depend on T and topk only (graph-capturable).
// ------------------------------------------------------------------------------------------------------------

// Sets sm.ints[0..ROWS) to the slots that picked the same expert as `leader` (padding -1) and returns their
// count, or -1 if an earlier slot picked that expert (this block has nothing to do). Needs n_slots <= NTHREADS.
template <int ROWS>
__device__ __forceinline__ int expert_slots(const int* ids, int n_slots, int leader, int* ints, int* expert) {
    const int j = threadIdx.x, warp = j >> 5, lane = j & 31;
    const int e = ids[leader];
    const int mine = j < n_slots ? ids[j] : -1;
    if (__syncthreads_or(j < leader && mine == e)) return -1;
    const u32 ballot = __ballot_sync(0xffffffffu, mine == e);
    if (lane == 0) ints[64 + warp] = __popc(ballot);
    if (j < ROWS) ints[16 + j] = -1;
    __syncthreads();
    if (mine == e) {
        int pos = __popc(ballot & ((1u << lane) - 1u));
        for (int w = 0; w < warp; ++w) pos += ints[64 + w];
        if (pos < ROWS) ints[16 + pos] = j;
    }
    int count = 0;
    for (int w = 0; w < WARPS; ++w) count += ints[64 + w];
    __syncthreads();
    *expert = e;
    return count < ROWS ? count : ROWS;
}

// Launch 1: gate and up. grid (n_slots, 2 * n1/128, splits): blockIdx.y = 2 * column block + (0 gate | 1 up).
// Partials [n_slots][splits][2][ROWS][n1]; the last of the 2*splits blocks of (leader, column block) applies the
// rotations, svh, the clamped SwiGLU and the routing weight and writes h[slot][n1] in fp16.
template <int ROWS>
__device__ __forceinline__ void moe_gate_up_body(const void* x, int ldx, int x_dtype, int topk, const int* ids,
                                                 const float* route, int n_slots, const u32* w1, const u16* suh1,
                                                 const u16* svh1, const u32* w3, const u16* suh3, const u16* svh3,
                                                 long long expert_words, u16* h, float* part, int* counters, int k1,
                                                 int n1, int splits, int xs_stride, float limit) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem sm = carve<ROWS>(smem_raw);
    const int leader = blockIdx.x, cb = blockIdx.y >> 1, up = blockIdx.y & 1, sp = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int e;
    wait_for_previous_kernel();  // the routing table comes from the previous kernel
    const int rows = expert_slots<ROWS>(ids, n_slots, leader, sm.ints, &e);
    if (rows < 0) return;
    // block rows read x at their slot's token
    if (threadIdx.x < ROWS) sm.ints[threadIdx.x] = sm.ints[16 + threadIdx.x] >= 0 ? sm.ints[16 + threadIdx.x] / topk : -1;
    __syncthreads();
    int kb_lo, nkb;
    kslice(k1, sp, splits, &kb_lo, &nkb);
    const u32* w = (up ? w3 : w1) + e * expert_words;
    const u16* suh = (up ? suh3 : suh1) + (long long)e * k1;
    const uint2 sv1 = load_svh4(svh1 + (long long)e * n1 + cb * 128, lane);
    const uint2 sv3 = load_svh4(svh3 + (long long)e * n1 + cb * 128, lane);
    block_product<ROWS>(sm, xs_stride, rows, x, ldx, x_dtype, w, suh, n1, cb, kb_lo, nkb);

    const long long split_stride = 2LL * ROWS * n1;
    float* base = part + (long long)leader * splits * split_stride;
    store_partial(sm.ys, base + sp * split_stride + up * (long long)ROWS * n1 + cb * 128, n1, rows);
    if (!last_to_arrive(counters + leader * (n1 / 128) + cb, 2 * splits, sm.ints + 32)) return;
    for (int r = warp; r < rows; r += WARPS) {
        float g[4], u[4];
        sum_partials(base, split_stride, (long long)r * n1 + cb * 128 + 4 * lane, splits, g);
        sum_partials(base + (long long)ROWS * n1, split_stride, (long long)r * n1 + cb * 128 + 4 * lane, splits, u);
        rotate_output(g, sv1, lane);
        rotate_output(u, sv3, lane);
        const int slot = sm.ints[16 + r];
        const float weight = route[slot];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float gi = fminf(g[i], limit), ui = fminf(fmaxf(u[i], -limit), limit);
            const float act = gi / (1.0f + expf(-gi)) * ui * weight;
            h[(long long)slot * n1 + cb * 128 + 4 * lane + i] = float_to_half(act);
        }
    }
}

// Launch 2: down. grid (n_slots, n2/128, splits). The leader's last split block writes each of its slots'
// rows to y[slot][n2] (fp32); the block that completes the column block for all n_slots slots sums every token's
// topk rows in slot order into out, plus addend's row (when given: the shared experts' output, one fp32 add after
// the slot sum, the bits of adding it to out afterwards).
template <int ROWS>
__device__ __forceinline__ void moe_down_body(const u16* h, const int* ids, int n_slots, int T, int topk,
                                              const u32* w2, const u16* suh2, const u16* svh2, long long expert_words,
                                              float* yslots, void* out, int ldo, int out_dtype, float* part,
                                              int* counters, int* counters_out, int k2, int n2, int splits,
                                              int xs_stride, const void* addend, int lda, int addend_dtype) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem sm = carve<ROWS>(smem_raw);
    const int leader = blockIdx.x, cb = blockIdx.y, sp = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int e;
    // The routing table may be read before waiting for the gate/up launch: that kernel lets this one start only
    // after all its blocks passed their own wait, so whatever wrote the table has finished. So the expert is
    // known, and its first weight stages load, while gate/up drains; h is read after the wait (in rotate_input).
    const int rows = expert_slots<ROWS>(ids, n_slots, leader, sm.ints, &e);
    if (rows < 0) return;
    // h rows are indexed by slot
    if (threadIdx.x < ROWS) sm.ints[threadIdx.x] = sm.ints[16 + threadIdx.x];
    __syncthreads();
    int kb_lo, nkb;
    kslice(k2, sp, splits, &kb_lo, &nkb);
    const uint2 sv2 = load_svh4(svh2 + (long long)e * n2 + cb * 128, lane);
    block_product<ROWS>(sm, xs_stride, rows, h, k2, 0, w2 + e * expert_words, suh2 + (long long)e * k2, n2,
                        cb, kb_lo, nkb);

    const long long split_stride = (long long)ROWS * n2;
    float* base = part + (long long)leader * splits * split_stride;
    store_partial(sm.ys, base + sp * split_stride + cb * 128, n2, rows);
    if (!last_to_arrive(counters + leader * (n2 / 128) + cb, splits, sm.ints + 32)) return;
    for (int r = warp; r < rows; r += WARPS) {
        float v[4];
        sum_partials(base, split_stride, (long long)r * n2 + cb * 128 + 4 * lane, splits, v);
        rotate_output(v, sv2, lane);
        *(float4*)(yslots + (long long)sm.ints[16 + r] * n2 + cb * 128 + 4 * lane) = make_float4(v[0], v[1], v[2], v[3]);
    }
    // count this expert's slots in; the block that brings the count to n_slots sums the column block
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int before = atomicAdd(counters_out + cb, rows);
        const bool last = before + rows == n_slots;
        if (last) counters_out[cb] = 0;
        sm.ints[32] = last;
    }
    __syncthreads();
    if (!sm.ints[32]) return;
    __threadfence();
    for (int t = warp; t < T; t += WARPS) {
        float v[4];
        // slots in order 0..topk-1 (the same partial-sum routine, the slot stride as its "split" stride)
        sum_partials(yslots + (long long)t * topk * n2, n2, cb * 128 + 4 * lane, topk, v);
        if (addend != nullptr) {
#pragma unroll
            for (int q = 0; q < 4; ++q) v[q] += load_value(addend, (long long)t * lda + cb * 128 + 4 * lane + q, addend_dtype);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) store_value(out, (long long)t * ldo + cb * 128 + 4 * lane + q, out_dtype, v[q]);
    }
}

#define GATE_UP_ARGS                                                                                            \
    const void *x, int ldx, int x_dtype, int topk, const int *ids, const float *route, int n_slots,             \
        const u32 *w1, const u16 *suh1, const u16 *svh1, const u32 *w3, const u16 *suh3, const u16 *svh3,       \
        long long expert_words, u16 *h, float *part, int *counters, int k1, int n1, int splits, int xs_stride, \
        float limit
#define GATE_UP_PASS                                                                                        \
    x, ldx, x_dtype, topk, ids, route, n_slots, w1, suh1, svh1, w3, suh3, svh3, expert_words, h, part, counters, \
        k1, n1, splits, xs_stride, limit
#define DOWN_ARGS                                                                                               \
    const u16 *h, const int *ids, int n_slots, int T, int topk, const u32 *w2, const u16 *suh2, const u16 *svh2, \
        long long expert_words, float *yslots, void *out, int ldo, int out_dtype, float *part, int *counters,    \
        int *counters_out, int k2, int n2, int splits, int xs_stride, const void *addend, int lda, int addend_dtype
#define DOWN_PASS                                                                                              \
    h, ids, n_slots, T, topk, w2, suh2, svh2, expert_words, yslots, out, ldo, out_dtype, part, counters,       \
        counters_out, k2, n2, splits, xs_stride, addend, lda, addend_dtype

extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_MOE_MIN_BLOCKS) exl3_moe_gate_up_r8(GATE_UP_ARGS) { moe_gate_up_body<8>(GATE_UP_PASS); }
extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_MOE_MIN_BLOCKS) exl3_moe_gate_up_r16(GATE_UP_ARGS) { moe_gate_up_body<16>(GATE_UP_PASS); }
extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_MOE_MIN_BLOCKS) exl3_moe_down_r8(DOWN_ARGS) { moe_down_body<8>(DOWN_PASS); }
extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_MOE_MIN_BLOCKS) exl3_moe_down_r16(DOWN_ARGS) { moe_down_body<16>(DOWN_PASS); }

// ------------------------------------------------------------------------------------------------------------
// decode only (tests and tools): W_q[k, n] fp16 from the trellis through the same fragment decode, one warp per tile
// ------------------------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(NTHREADS) exl3_decode(const u32* trellis, u16* out, int k, int n) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tiles_n = n / 16;
    const long long tile = (long long)blockIdx.x * WARPS + warp;
    if (tile >= (long long)(k / 16) * tiles_n) return;
    const int tk = (int)(tile / tiles_n), tn = (int)(tile - (long long)tk * tiles_n);
    int off[NW];
    u32 sh;
    lane_offsets(lane, off, &sh);
    u32 frag[4];
    decode_tile(trellis + tile * TW, off, sh, frag);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        // A fragment register q holds (n = g + 8(q&1), k = 2t + 8(q>>1)) and k + 1
        const long long col = 16LL * tn + g + 8 * (q & 1);
        const long long row = 16LL * tk + 2 * t + 8 * (q >> 1);
        out[row * n + col] = (u16)(frag[q] & 0xFFFFu);
        out[(row + 1) * n + col] = (u16)(frag[q] >> 16);
    }
}

// ------------------------------------------------------------------------------------------------------------
// prefill (issue 31): a tile of up to ROWS rows (64 or 128) x one 128-column block, the whole k in one block
// grid (tiles, n/128), or (n/128, tiles) with columns_first; out[dest(row)] = rot(xh[row] @ W_q[e]) * svh[e]
// ------------------------------------------------------------------------------------------------------------
// The input arrives rotated (kernels/exl3/prefill.py rotates it once per chunk), fp16, each 128-block of a row in
// b_word_pos order. Each k block of the tile's rows (256 B a row) is copied to a shared-memory ring with cp.async by
// the whole block, in the same commit groups as each warp's weight stage, so one wait and one block barrier per k
// block publish both; lanes then read their B operands as in load_b. Each decoded weight fragment feeds ROWS / 8
// mma (one per 8 rows) instead of 1-2: the decode is shared by the tile's rows. One accumulation chain per output
// element in k order (no split): a row's bits depend on its own B column only, so not on the other rows of its
// tile, its place in it, the tile's size (64 or 128: the same chain over the same decoded fragments) or the chunk
// (row invariance, as above). `table` [tiles][3] (expert, first row, rows; rows 0 = a spare block) for grouped
// products (the routed experts), else one matrix and tile t = rows [t * ROWS, ...); `out_rows` (optional) the
// output row of each input row. xh holds ROWS rows past the last real one (copied, never used: their products are
// not stored).
//
// Row parts: a tile's rows in parts of 32 (4 row groups); the parts past its count are neither copied nor
// multiplied (their rows would not be stored), so a partial tile (an expert's last, a small expert's only one)
// costs its decodes and the mma of its own parts only: a 128-row tile of <= 64 rows does the 64-row tile's work.
// The branch is warp-uniform (the count is the block's).
//
// Two entries of one body (prefill_cuda.py's shared_bytes mirrors their shared memory):
// - exl3_prefill_r64: the image's STAGES (3), B rows padded to PF_XS_STRIDE; 66-108 KB (K 1-8): 2 blocks an SM.
// - exl3_prefill_r128: each fragment feeds 16 mma. PF128_STAGES (2) and B rows unpadded (256 B) with the 16-byte
//   chunks of odd rows XOR-swizzled by 4 (the same bank spread as the padding: rows 2i and 2i+1 of a 128-bit
//   load's phase fall in opposite bank halves); 68-96 KB (K 1-8): 2 blocks an SM on Hopper at a 128-register
//   budget (K <= 6; K = 7, 8 take more registers: one block), and it fits GB10's 99 KB. Three padded stages (a
//   120 KB B ring) would leave one block an SM on Hopper and no fit on GB10.
// The epilogue's fp32 tile reuses the whole buffer (both rings) once the k loop is done.
#define PF_PART 32                            // rows per row part (4 row groups)
#define PF_XS_STRIDE 160                      // fp16 row stride of a padded B stage: 16 words mod 32 (b_word_pos)
#ifndef EXL3_PF_MIN_BLOCKS
#define EXL3_PF_MIN_BLOCKS 2
#endif
#ifndef EXL3_PF128_STAGES
#define EXL3_PF128_STAGES 2
#endif
#ifndef EXL3_PF128_MIN_BLOCKS
#define EXL3_PF128_MIN_BLOCKS (K >= 7 ? 1 : 2)  // K = 7, 8 spill 8-16 bytes at 128 registers (137-140 without)
#endif

template <int ROWS, int NST, bool SWIZZLE>
struct PrefillLoop {
    static constexpr int B_STRIDE = SWIZZLE ? 128 : PF_XS_STRIDE;  // fp16 per B row
    static constexpr int B_STAGE = ROWS * B_STRIDE;                // fp16 per B stage
    static constexpr int B_CHUNKS = ROWS * 16;                     // 16-byte chunks per B stage
    static constexpr int RING = NST * KR * TW;                     // words of a warp's weight ring
    static_assert(ROWS % PF_PART == 0 && B_CHUNKS % NTHREADS == 0, "whole parts, whole chunks per thread");
    static_assert(NST >= 2 && NST <= 4, "the prologue issues up to 3 stages");
    float* acc;
    const u32* ring;   // this warp's weight ring [NST][KR][TW]
    u16* bring;        // the block's B ring [NST][B_STAGE]
    const u16* xsrc;   // this thread's first B chunk: row first + tid / 16 of xh, the 8 fp16 at (tid % 16) * 8
    int off[NW];
    u32 sh;
    int n_stages, lane, tid, k;
    int used;          // the tile's rows rounded up to whole parts: the rows copied and multiplied
    StageCopy copy;

    __device__ __forceinline__ void wait_stages() { asm volatile("cp.async.wait_group %0;" ::"n"(NST - 2)); }

    // This thread's share of B stage `it` into ring slot SLOT (no-op past the last stage).
    template <int SLOT>
    __device__ __forceinline__ void issue_b(int it) {
        if (it >= n_stages) return;
#pragma unroll
        for (int j = 0; j < B_CHUNKS / NTHREADS; ++j) {  // chunk tid + 256 j: 16 rows further per j
            if (16 * j >= used) break;  // whole parts only (used is a multiple of 32): uniform per 16 rows
            const int row = (tid >> 4) + 16 * j;
            const int chunk = SWIZZLE ? (tid & 15) ^ ((row & 1) << 2) : (tid & 15);
            cp_async16(smem_addr(bring + SLOT * B_STAGE + row * B_STRIDE + chunk * 8),
                       xsrc + 16LL * j * k + (long long)it * 128);
        }
    }

    template <int SLOT>
    __device__ __forceinline__ void stage_product() {
        const u32* stage = ring + SLOT * KR * TW;
        const u16* bs = bring + SLOT * B_STAGE + (lane >> 2) * B_STRIDE + 8 * (lane & 3);
        const int odd = (lane >> 2) & 1;  // this lane's B rows (g + 8h) are odd: their chunks are swizzled
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            u32 frag0[4], frag1[4];  // tile rows 2q and 2q + 1 of the stage (k order)
            decode_tile(stage + 2 * q * TW, off, sh, frag0);
            decode_tile(stage + (2 * q + 1) * TW, off, sh, frag1);
            const int qc = SWIZZLE ? q ^ odd : q;  // chunk 4q + t of the row, at 4(q ^ odd) + t when swizzled
            // each row group's B operand just before its two mma (4 registers live, not one per group):
            // chunk q of the group's rows holds k rows 2q (x, y) and 2q + 1 (z, w)
#pragma unroll
            for (int p = 0; p < ROWS / PF_PART; ++p) {
                if (p > 0 && PF_PART * p >= used) break;
#pragma unroll
                for (int i = 0; i < PF_PART / 8; ++i) {
                    const int h = p * (PF_PART / 8) + i;
                    const uint4 b = *((const uint4*)(bs + 8 * h * B_STRIDE) + 4 * qc);
                    mma_16816(acc + 4 * h, frag0, b.x, b.y);
                    mma_16816(acc + 4 * h, frag1, b.z, b.w);
                }
            }
        }
    }

    template <int S>
    __device__ __forceinline__ void round_from(int base) {
        if constexpr (S < NST) {
            const int it = base + S;
            if (it >= n_stages) return;
            wait_stages();
            __syncthreads();  // stage `it` (weights and B) visible to all; every warp is done with stage it-1
            constexpr int NEXT = (S + NST - 1) % NST;
            issue_stage<NEXT>(copy, it + NST - 1 < n_stages, lane);
            issue_b<NEXT>(it + NST - 1);
            cp_async_commit();
            stage_product<S>();
            round_from<S + 1>(base);
        }
    }
};

#define PREFILL_ARGS                                                                                              \
    const u32 *__restrict__ trellis, const u16 *__restrict__ svh, const u16 *__restrict__ xh,                     \
        const int *__restrict__ table, const int *__restrict__ out_rows, void *__restrict__ out, int ldo,          \
        int out_dtype, int n_rows, int k, int n, int columns_first
#define PREFILL_PASS trellis, svh, xh, table, out_rows, out, ldo, out_dtype, n_rows, k, n, columns_first

// A prefill block's tile: its column block, expert, first row and rows (count <= 0: nothing to do).
struct PrefillTile {
    int cb, e, first, count;
};

template <int ROWS>
__device__ __forceinline__ PrefillTile prefill_tile(const int* table, int n_rows, int columns_first) {
    // columns_first: a tile's column blocks are neighbours in launch order, so its B rows are read from HBM about
    // once and then from L2 (tiles first: every column block's pass reads all of xh again); the bits are the same
    const int tile = columns_first ? blockIdx.y : blockIdx.x;
    PrefillTile t{columns_first ? (int)blockIdx.x : (int)blockIdx.y, 0, 0, 0};
    if (table != nullptr) {
        wait_for_previous_kernel();  // the table is written by the launches before this one
        t.e = table[3 * tile];
        t.first = table[3 * tile + 1];
        t.count = table[3 * tile + 2];
    } else {
        t.first = tile * ROWS;
        t.count = min(ROWS, n_rows - t.first);
    }
    return t;
}

// After the k loop: the accumulators through the block's fp32 tile `ys` (which reuses the rings: every warp must be
// done with them), then per row the output rotation, svh and the store to its output row.
template <int ROWS>
__device__ __forceinline__ void prefill_epilogue(const float* acc, float* ys, const PrefillTile& t, uint2 sv,
                                                 const int* out_rows, void* out, int ldo, int out_dtype, int warp,
                                                 int lane) {
    asm volatile("cp.async.wait_all;");
    let_next_kernel_start();
    __syncthreads();  // every warp is done reading both rings before the epilogue's tile overwrites them
    stash_acc<ROWS>(acc, ys, warp, lane);
    __syncthreads();
    for (int r = warp; r < t.count; r += WARPS) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = ys[r * YS_STRIDE + 4 * lane + i];
        rotate_output(v, sv, lane);
        const long long dest = out_rows != nullptr ? (long long)out_rows[t.first + r] : (long long)(t.first + r);
#pragma unroll
        for (int i = 0; i < 4; ++i) store_value(out, dest * ldo + t.cb * 128 + 4 * lane + i, out_dtype, v[i]);
    }
}

template <int ROWS, int NST, bool SWIZZLE>
__device__ __forceinline__ void prefill_body(unsigned char* smem, PREFILL_ARGS) {
    using Loop = PrefillLoop<ROWS, NST, SWIZZLE>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
    const PrefillTile t = prefill_tile<ROWS>(table, n_rows, columns_first);
    const int e = t.e, first = t.first, count = t.count, cb = t.cb;
    if (count <= 0) return;  // the whole block: before any barrier
    u32* rings = (u32*)smem;
    u16* bring = (u16*)(rings + WARPS * Loop::RING);
    float* ys = (float*)smem;  // the epilogue's tile reuses the whole buffer once the k loop is done
    const long long row_stride_words = (long long)(n / 16) * TW;
    const int n_stages = k / 128;
    const u32* tile_col = trellis + (long long)e * (k / 16) * row_stride_words + (long long)cb * ROW_WORDS + warp * TW;
    const uint2 sv = load_svh4(svh + (long long)e * n + cb * 128, lane);
    Loop L;
    float acc[ROWS / 2];  // 4 per row group
#pragma unroll
    for (int i = 0; i < ROWS / 2; ++i) acc[i] = 0.f;
    L.acc = acc;
    L.ring = rings + warp * Loop::RING;
    L.bring = bring;
    L.xsrc = xh + (long long)(first + (tid >> 4)) * k + (tid & 15) * 8;
    lane_offsets(lane, L.off, &L.sh);
    L.n_stages = n_stages;
    L.lane = lane;
    L.tid = tid;
    L.k = k;
    L.used = (count + PF_PART - 1) / PF_PART * PF_PART;
    wait_for_previous_kernel();  // xh is written by the launch before this one
    // the first NST - 1 stages, weights and B together in one commit group each
    L.copy = stage_copy(L.ring, tile_col, row_stride_words, 0, lane);
    issue_stage<0>(L.copy, 0 < n_stages, lane);
    L.template issue_b<0>(0);
    cp_async_commit();
    if constexpr (NST > 2) {
        issue_stage<1>(L.copy, 1 < n_stages, lane);
        L.template issue_b<1>(1);
        cp_async_commit();
    }
    if constexpr (NST > 3) {
        issue_stage<2>(L.copy, 2 < n_stages, lane);
        L.template issue_b<2>(2);
        cp_async_commit();
    }
    for (int base = 0; base < n_stages; base += NST) L.template round_from<0>(base);
    prefill_epilogue<ROWS>(acc, ys, t, sv, out_rows, out, ldo, out_dtype, warp, lane);
}

extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_PF_MIN_BLOCKS) exl3_prefill_r64(PREFILL_ARGS) {
    extern __shared__ __align__(16) unsigned char pf_smem[];
    prefill_body<64, STAGES, false>(pf_smem, PREFILL_PASS);
}
extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_PF128_MIN_BLOCKS) exl3_prefill_r128(PREFILL_ARGS) {
    extern __shared__ __align__(16) unsigned char pf_smem[];
    prefill_body<128, EXL3_PF128_STAGES, true>(pf_smem, PREFILL_PASS);
}

// ------------------------------------------------------------------------------------------------------------
// prefill on Hopper's warpgroup MMA (issue 31; compiled only with -DEXL3_WGMMA=1 for sm_90a): exl3_prefill_wg128
// ------------------------------------------------------------------------------------------------------------
// The tile of exl3_prefill_r128 (up to 128 rows x one 128-column block, the whole k, the same table, out_rows,
// epilogue and arguments) with each warpgroup's products as one wgmma.m64nNk16 a k step instead of 16 mma.m16n8k16
// a warp: each warp still decodes its 16 columns' fragment straight into registers (the A operand: wgmma's register
// A fragment of a warp is mma.m16n8k16's), and the tile's rows are the B operand, read by the tensor cores from
// shared memory (K-major, 128-byte swizzle) instead of by every warp through its registers (the r128 kernel reads
// the whole B tile once a warp: 8x the bytes, and as many load instructions as mma). N is the tile's used rows (32,
// 64, 96 or 128: whole row parts, as r128's row parts), so a small expert's tile multiplies its own rows only.
// The input here is in natural k order (kernels/exl3/prefill.py's rotation without PERMUTE), with PAD rows past
// the last real one, as r128's.
// Bits: one fp32 accumulation chain per output element over the k steps in k order, each step one k16 product of
// the tensor core; whether the wgmma's k16 product rounds as mma.sync's is the GPU's to say (tests/
// test_exl3_prefill_wgmma.py compares the two bitwise and reports); a row's element never depends on the other
// rows or on N (the same test, rows alone / in full tiles / permuted).
#if defined(EXL3_WGMMA)
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "EXL3_WGMMA needs sm_90a (wgmma)"
#endif
#ifndef EXL3_WG_STAGES
#define EXL3_WG_STAGES 2
#endif
#ifndef EXL3_WG_MIN_BLOCKS
// 128 registers: two blocks an SM (bench/results/prefill_tiles_ab_95e36f2.json); K = 7, 8 would spill 8 bytes there
#define EXL3_WG_MIN_BLOCKS (K >= 7 ? 1 : 2)
#endif
// A/B (DSV41_EXL3_TUNING): PREFETCH loads the next k step's trellis words before this step's decode and product
// (their shared-memory latency behind the decode); RELAXED drops the compiler memory clobbers of the wgmma fences
// (the asynchronous products read only B, which the stage's barrier orders), so the compiler may schedule the
// decode's loads across them. The same products in the same order either way: the same bits.
#ifndef EXL3_WG_PREFETCH
#define EXL3_WG_PREFETCH 1  // H100, 2,048 rows: 4.39 -> 3.97 ms (8,192: 7.53 -> 7.59), the same bits
#endif
#ifndef EXL3_WG_RELAXED
#define EXL3_WG_RELAXED 0
#endif
// DESC: each k step's B descriptor as the stage's first one plus a constant (b_desc's address field is the shared
// address / 16 and the steps move it by 32 B and 16 KiB: no carry out of the field), instead of b_desc of the
// step's address; per k step ~5 uniform-datapath instructions less of the ~52 a warp issues (the issue slots are
// the kernel's bound: bench/results/ncu/). The same descriptors: the same bits.
#ifndef EXL3_WG_DESC
#define EXL3_WG_DESC 1
#endif
// BSLOTS: the B ring's slots. 2: a stage's copies go into the slot the stage before read, so every stage ends in
// wgmma_wait<0> (the pipeline drained) before the block barrier. 3: the slot written was read two stages before,
// whose products are done by then (at most the last 3 of a warpgroup's products are in flight at a barrier), so no
// drain: each k step waits for the product 4 steps back, across stages too. 96 KiB of B (K <= 4 keeps two blocks an
// SM). The same products in the same order: the same bits.
#ifndef EXL3_WG_BSLOTS
#define EXL3_WG_BSLOTS 2
#endif
#if EXL3_WG_RELAXED
#define WG_MEM
#define WG_MEM_IN
#define WG_MEM_OUT
#else
#define WG_MEM ::: "memory"   // the clobber of an asm without operands,
#define WG_MEM_IN : "memory"  // with inputs only,
#define WG_MEM_OUT :: "memory"  // with outputs only
#endif
#define WG_ROWS 128
#define WG_ATOM_BYTES (WG_ROWS * 128)          // one 64-deep k half of a B stage: 128 rows x 128 B (8-row atoms)
#define WG_B_STAGE_BYTES (2 * WG_ATOM_BYTES)  // a 128-deep B stage: 32 KiB

__device__ __forceinline__ void wgmma_n32(float* d, const u32* a, unsigned long long desc) {
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
        "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_n64(float* d, const u32* a, unsigned long long desc) {
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
        "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_n96(float* d, const u32* a, unsigned long long desc) {
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %53, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47"
        "}, {%48,%49,%50,%51}, %52, p, 1, 1, 0;}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_n128(float* d, const u32* a, unsigned long long desc) {
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
        "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" WG_MEM); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" WG_MEM); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) WG_MEM_IN); }
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// keeps the compiler from moving accumulator reads or writes across the asynchronous products
__device__ __forceinline__ void fence_acc(float* acc) {
#pragma unroll
    for (int i = 0; i < WG_ROWS / 2; ++i) asm volatile("" : "+f"(acc[i]) WG_MEM_OUT);
}

// Descriptor of a K-major B operand of 8-row, 128-byte swizzled atoms (rows 128 B apart, atoms 1024 B apart);
// `addr` is the shared address of the k step's first row (the atom's base + 32 B a k16 step; atoms 1024-aligned).
__device__ __forceinline__ unsigned long long b_desc(u32 addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

template <int N>
__device__ __forceinline__ void wgmma_rows(float* acc, const u32* a, unsigned long long desc) {
    if constexpr (N == 32) wgmma_n32(acc, a, desc);
    else if constexpr (N == 64) wgmma_n64(acc, a, desc);
    else if constexpr (N == 96) wgmma_n96(acc, a, desc);
    else wgmma_n128(acc, a, desc);
}

struct WgState {
    const u32* ring;   // this warp's weight ring [WG_STAGES][KR][TW]
    u32 bring;         // shared address of the block's B ring [WG_STAGES][2][128 rows][128 B], 1024-aligned
    const u16* xrow;   // row first + tid / 16 of xh
    int off[NW];
    u32 sh;
    int n_stages, lane, tid, k, used;
    StageCopy copy;
};

// This thread's share of B stage `it` into ring slot `slot`: rows tid / 16 + 16 j, 16-byte chunk tid % 16 (k
// 8c .. 8c + 7 of the 128-deep block) at its swizzled place; only the used rows.
__device__ __forceinline__ void wg_issue_b(const WgState& S, int it, int slot) {
    if (it >= S.n_stages) return;
    const int c = S.tid & 15, half = c >> 3, cc = c & 7;
#pragma unroll
    for (int j = 0; j < WG_ROWS / 16; ++j) {
        if (16 * j >= S.used) break;
        const int row = (S.tid >> 4) + 16 * j;
        const u32 dst = S.bring + slot * WG_B_STAGE_BYTES + half * WG_ATOM_BYTES + row * 128 + ((cc ^ (row & 7)) << 4);
        cp_async16(dst, S.xrow + 16LL * j * S.k + (long long)it * 128 + c * 8);
    }
}

__device__ __forceinline__ void wg_issue_weights(WgState& S, int slot, bool load) {
#pragma unroll
    for (int j = 0; j < LANE_CHUNKS; ++j) {
        if (load && (STAGE_CHUNKS % 32 == 0 || j + 1 < LANE_CHUNKS || S.lane + 32 * j < STAGE_CHUNKS))
            cp_async16(S.copy.dst[j] + slot * KR * TW * 4, S.copy.src[j]);
        S.copy.src[j] += S.copy.step;
    }
}

// The k loop: per 128-deep stage one wait and one block barrier (the stage's weights and B visible, every warp's
// products of the stage before done), the copies of a later stage, then 8 k steps, each a decode into registers and
// one wgmma of the warpgroup; fragments rotate through 4 register sets, so a step's decode overlaps the 3 products
// before it.
template <int N>
__device__ __forceinline__ void wg_loop(WgState& S, float* acc) {
    for (int it = 0; it < S.n_stages; ++it) {
        const int slot = it % EXL3_WG_STAGES, bslot = it % EXL3_WG_BSLOTS;
        asm volatile("cp.async.wait_group %0;" ::"n"(EXL3_WG_STAGES - 2));
        fence_async_shared();  // the cp.async writes (generic proxy) visible to the tensor cores' reads (async proxy)
        __syncthreads();
        const int next = it + EXL3_WG_STAGES - 1, nslot = next % EXL3_WG_STAGES;
        wg_issue_weights(S, nslot, next < S.n_stages);
        wg_issue_b(S, next, next % EXL3_WG_BSLOTS);
        cp_async_commit();
        const u32* stage = S.ring + slot * KR * TW;
        const u32 bbase = S.bring + bslot * WG_B_STAGE_BYTES;
#if EXL3_WG_DESC
        const unsigned long long desc0 = b_desc(bbase);
#endif
        u32 frag[4][4];
#if EXL3_WG_PREFETCH
        u32 words[2][NW];
#pragma unroll
        for (int i = 0; i < NW; ++i) words[0][i] = stage[S.off[i]];
#endif
#pragma unroll
        for (int s = 0; s < KR; ++s) {
#if EXL3_WG_PREFETCH
            if (s + 1 < KR) {
#pragma unroll
                for (int i = 0; i < NW; ++i) words[(s + 1) & 1][i] = stage[(s + 1) * TW + S.off[i]];
            }
#endif
            if (s >= 4 || EXL3_WG_BSLOTS > 2) wgmma_wait<3>();  // step s - 4, the last reader of frag[s % 4], is done
#if EXL3_WG_PREFETCH
            decode_words(words[s & 1], S.sh, frag[s & 3]);
#else
            decode_tile(stage + s * TW, S.off, S.sh, frag[s & 3]);
#endif
            wgmma_fence();
            fence_acc(acc);
#if EXL3_WG_DESC
            wgmma_rows<N>(acc, frag[s & 3], desc0 + (unsigned long long)(((s >> 2) * WG_ATOM_BYTES + (s & 3) * 32) >> 4));
#else
            wgmma_rows<N>(acc, frag[s & 3], b_desc(bbase + (s >> 2) * WG_ATOM_BYTES + (s & 3) * 32));
#endif
            fence_acc(acc);
            wgmma_commit();
        }
#if EXL3_WG_BSLOTS == 2
        wgmma_wait<0>();  // the stage's B slot is overwritten after the next barrier
        fence_acc(acc);
#endif
    }
#if EXL3_WG_BSLOTS > 2
    wgmma_wait<0>();
    fence_acc(acc);
#endif
}

extern "C" __global__ void __launch_bounds__(NTHREADS, EXL3_WG_MIN_BLOCKS) exl3_prefill_wg128(PREFILL_ARGS) {
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
    const PrefillTile t = prefill_tile<WG_ROWS>(table, n_rows, columns_first);
    const int e = t.e, first = t.first, count = t.count, cb = t.cb;
    if (count <= 0) return;
    // the B ring first, at the first 1024-aligned shared address (the swizzle is of absolute address bits)
    const u32 base = smem_addr(wg_smem);
    const u32 pad = (1024 - (base & 1023)) & 1023;
    unsigned char* aligned = wg_smem + pad;
    u32* rings = (u32*)(aligned + EXL3_WG_BSLOTS * WG_B_STAGE_BYTES);
    float* ys = (float*)aligned;  // the epilogue's tile reuses the buffer once the k loop is done
    const long long row_stride_words = (long long)(n / 16) * TW;
    const u32* tile_col = trellis + (long long)e * (k / 16) * row_stride_words + (long long)cb * ROW_WORDS + warp * TW;
    const uint2 sv = load_svh4(svh + (long long)e * n + cb * 128, lane);
    WgState S;
    S.ring = rings + warp * EXL3_WG_STAGES * KR * TW;
    S.bring = base + pad;
    S.xrow = xh + (long long)(first + (tid >> 4)) * k;
    lane_offsets(lane, S.off, &S.sh);
    S.n_stages = k / 128;
    S.lane = lane;
    S.tid = tid;
    S.k = k;
    S.used = (count + PF_PART - 1) / PF_PART * PF_PART;
    float acc[WG_ROWS / 2];
#pragma unroll
    for (int i = 0; i < WG_ROWS / 2; ++i) acc[i] = 0.f;
    wait_for_previous_kernel();
    S.copy = stage_copy(S.ring, tile_col, row_stride_words, 0, lane);
#pragma unroll
    for (int s = 0; s < EXL3_WG_STAGES - 1; ++s) {
        wg_issue_weights(S, s, s < S.n_stages);
        wg_issue_b(S, s, s);
        cp_async_commit();
    }
    switch (S.used >> 5) {  // uniform over the block
        case 1: wg_loop<32>(S, acc); break;
        case 2: wg_loop<64>(S, acc); break;
        case 3: wg_loop<96>(S, acc); break;
        default: wg_loop<128>(S, acc); break;
    }
    // wgmma's D fragment of a warp is mma's (a row group per 8 columns), so r128's epilogue stashes it as is
    prefill_epilogue<WG_ROWS>(acc, ys, t, sv, out_rows, out, ldo, out_dtype, warp, lane);
}
#endif  // EXL3_WGMMA
