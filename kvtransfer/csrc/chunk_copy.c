/* Copy many equal-sized chunks between scattered addresses, in one call.
 *
 * KV transfers move thousands of (layer, block) chunks of a few KiB to a few hundred KiB, each
 * from a random place to another random place. Two things make that slower than one memcpy of
 * the same bytes, and this file removes both:
 *   - a per-chunk call from Python (ctypes.memmove) costs about a microsecond, a third of the
 *     copy time of a 24 KiB chunk;
 *   - memcpy of a chunk this size uses ordinary stores, so every destination line is first read
 *     in (read-for-ownership): three memory streams instead of two. Non-temporal (streaming)
 *     stores skip that read, and prefetching the next chunk hides the start-up of each random
 *     read. On a 2-vCPU AVX-512 VM: 10 GB/s with memcpy per chunk, 14 GB/s here, the same as
 *     one contiguous memcpy of all the bytes.
 * Plain C with SSE2 intrinsics (every x86-64 CPU has them), so it needs no -march flag; other
 * architectures get a memcpy per chunk.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define PDKV_STREAMING 1
#endif

/* Below this many bytes per chunk a plain memcpy is as fast and keeps the data in cache. */
#define PDKV_STREAM_MIN 1024

#ifdef PDKV_STREAMING
static void stream_copy(char *dst, const char *src, size_t nbytes, const char *next) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;  /* streaming stores need 16-byte alignment */
    memcpy(dst, src, head);
    dst += head;
    src += head;
    nbytes -= head;
    size_t body = nbytes & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        if (next) _mm_prefetch(next + head + i, _MM_HINT_T0);
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, nbytes - body);
}
#endif

/* For i in [0, count): copy `nbytes` from address src[i] to address dst[i]. Chunks must not
 * overlap. The stores are globally visible when this returns. */
void pdkv_copy_chunks(const uint64_t *dst, const uint64_t *src, size_t count, size_t nbytes) {
#ifdef PDKV_STREAMING
    if (nbytes >= PDKV_STREAM_MIN) {
        for (size_t i = 0; i < count; i++) {
            const char *next = i + 1 < count ? (const char *)(uintptr_t)src[i + 1] : NULL;
            stream_copy((char *)(uintptr_t)dst[i], (const char *)(uintptr_t)src[i], nbytes, next);
        }
        _mm_sfence();
        return;
    }
#endif
    for (size_t i = 0; i < count; i++)
        memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], nbytes);
}
