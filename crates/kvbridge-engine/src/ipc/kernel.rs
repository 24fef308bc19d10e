//! The batched copy kernel (CUDA C++, compiled at run time with NVRTC).
//!
//! One launch copies a whole descriptor array: each descriptor `(src, dst,
//! len)` is packed into 16 bytes (48-bit addresses, the length's two 16-bit
//! halves in the top bits, see [`super::schedule::pack`]). A group of
//! `1 << shift` threads copies one descriptor; groups stride over the array.
//! Within a descriptor the widest word that the source and destination
//! share an alignment for (16, 8, 4, 2 bytes) is used for the body, eight
//! loads in flight per thread; the unaligned head and the tail are copied
//! byte by byte. Destinations must not overlap each other (sources may).
//! (Evict-first cache hints on the loads and stores, `ld/st.global.cs`,
//! measured 4-5% slower end to end on the H200, so plain ones are used.)

/// Name of the kernel's entry point.
pub const ENTRY: &str = "kvb_batch_copy";

/// Name of the strided-run kernel's entry point: a run descriptor is two
/// 16-byte entries, `[src, dst]` and `[len | count << 32, src_stride |
/// dst_stride << 32]` (see [`super::schedule::pack_run`]); work item `w` is
/// copy `w % 2^kshift` of descriptor `w >> kshift` (items past a
/// descriptor's count do nothing), a group of `1 << shift` threads each.
pub const RUN_ENTRY: &str = "kvb_run_copy";

/// The kernel source.
pub const SOURCE: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;

template <typename T>
__device__ __forceinline__ void copy_words(unsigned char* dst, const unsigned char* src,
                                           u64 len, u32 lane, u32 g) {
    const u64 w = sizeof(T);
    u64 head = (w - ((u64)src & (w - 1))) & (w - 1);
    if (head > len) head = len;
    for (u64 k = lane; k < head; k += g) dst[k] = src[k];
    const u64 body = (len - head) / w;
    const T* s = reinterpret_cast<const T*>(src + head);
    T* d = reinterpret_cast<T*>(dst + head);
    u64 k = lane;
    for (; k + 7ull * g < body; k += 8ull * g) {
        T v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = s[k + j * (u64)g];
#pragma unroll
        for (int j = 0; j < 8; j++) d[k + j * (u64)g] = v[j];
    }
    for (; k < body; k += g) d[k] = s[k];
    for (u64 t = head + body * w + lane; t < len; t += g) dst[t] = src[t];
}

__device__ __forceinline__ void copy_any(unsigned char* dst, const unsigned char* src,
                                         u64 len, u32 lane, u32 g) {
    const u64 x = (u64)src ^ (u64)dst;
    if ((x & 15) == 0) {
        copy_words<uint4>(dst, src, len, lane, g);
    } else if ((x & 7) == 0) {
        copy_words<uint2>(dst, src, len, lane, g);
    } else if ((x & 3) == 0) {
        copy_words<u32>(dst, src, len, lane, g);
    } else if ((x & 1) == 0) {
        copy_words<unsigned short>(dst, src, len, lane, g);
    } else {
        for (u64 k = lane; k < len; k += g) dst[k] = src[k];
    }
}

extern "C" __global__ void kvb_batch_copy(const ulonglong2* __restrict__ descs, u64 n, u32 shift) {
    const u32 g = 1u << shift;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u32 lane = (u32)(tid & (g - 1));
    const u64 groups = ((u64)gridDim.x * blockDim.x) >> shift;
    const u64 mask = (1ull << 48) - 1;
    for (u64 i = tid >> shift; i < n; i += groups) {
        const ulonglong2 dsc = descs[i];
        const unsigned char* src = (const unsigned char*)(dsc.x & mask);
        unsigned char* dst = (unsigned char*)(dsc.y & mask);
        const u64 len = (dsc.x >> 48) | ((dsc.y >> 48) << 16);
        copy_any(dst, src, len, lane, g);
    }
}

extern "C" __global__ void kvb_run_copy(const ulonglong2* __restrict__ descs, u64 n,
                                        u32 kshift, u32 shift) {
    const u32 g = 1u << shift;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u32 lane = (u32)(tid & (g - 1));
    const u64 groups = ((u64)gridDim.x * blockDim.x) >> shift;
    const u64 items = n << kshift;
    const u64 kmask = (1ull << kshift) - 1;
    const u64 lo = 0xffffffffull;
    for (u64 w = tid >> shift; w < items; w += groups) {
        const u64 i = w >> kshift;
        const u64 j = w & kmask;
        const ulonglong2 shape = descs[2 * i + 1];
        if (j >= (shape.x >> 32)) continue;
        const ulonglong2 base = descs[2 * i];
        const unsigned char* src = (const unsigned char*)(base.x + j * (shape.y & lo));
        unsigned char* dst = (unsigned char*)(base.y + j * (shape.y >> 32));
        copy_any(dst, src, shape.x & lo, lane, g);
    }
}
"#;
