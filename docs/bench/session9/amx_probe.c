// Probe (ninth session), not part of Forge: would AMX-INT8 lift the vec2x64 decode kernel off
// the `vpdpbusd` port? A sketch of the inner loop: per 16 output rows (8 row pairs) and 64
// input columns, the 64-entry lookups of each row (vpermb) are stored to a 1 KiB A tile, the
// activations' three byte planes (h, l, q2) are the 3 columns of a B tile in VNNI order, and
// one tdpbusd accumulates C (16 rows x 3 planes). The lookup tables and data are dummies; the
// instruction mix and the memory streams are the real kernel's. Single thread; compare with
// decode_ab_1thread.txt (the 512-bit kernel, same session). Linux needs arch_prctl for AMX.
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <time.h>
typedef struct { uint8_t palette_id, start_row, r[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;
static double now(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9; }
// Simulated vec2x64 decode GEMV: rows R (pairs R/2), cols K. index data per row pair per 64 cols: 48 bytes (32 nibble + 16 top-bit bytes)
int main(int argc, char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  int R = argc>1? atoi(argv[1]) : 17408, K = 5120; int P = K/64;
  size_t rowpair_bytes = (size_t)P*48;
  uint8_t* idx = aligned_alloc(64, (size_t)(R/2)*rowpair_bytes + 4096); memset(idx, 0x5a, (size_t)(R/2)*rowpair_bytes+4096);
  for (size_t i=0;i<(size_t)(R/2)*rowpair_bytes;i++) idx[i]=rand();
  int8_t* Bx = aligned_alloc(64, P*16*64); memset(Bx, 1, P*16*64);
  cfg_t c; memset(&c,0,sizeof c); c.palette_id=1;
  c.colsb[0]=12; c.rows[0]=16; // C: 16 rows x 3 int32
  c.colsb[1]=64; c.rows[1]=16; // A: 16 rows x 64 bytes
  c.colsb[2]=12; c.rows[2]=16; // B: 16 rows (k/4) x 3*4 bytes
  _tile_loadconfig(&c);
  __m512i tab0 = _mm512_set1_epi32(0x01020304), tab1 = _mm512_set1_epi32(0x05060708);
  static uint8_t A[2][16*64] __attribute__((aligned(64)));
  static int32_t Cout[16*3];
  int reps = argc>1 ? 200 : 5; double best = 1e9;
  for (int rep=0; rep<reps; rep++){
  double t0 = now(); long sink=0;
  for (int g=0; g<R/16; g++){           // 16 output rows = 8 row pairs
    _tile_zero(0);
    for (int p=0;p<P;p++){
      uint8_t* Ab = A[p&1];
      for (int q=0;q<8;q++){
        const uint8_t* src = idx + (size_t)(g*8+q)*rowpair_bytes + (size_t)p*48;
        _mm_prefetch((const char*)src + 2048, _MM_HINT_T0);
        __m512i nib = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)src));
        __m512i top = _mm512_broadcast_i64x2(_mm_loadu_si128((const __m128i*)(src+32)));
        __m512i ix = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x0706050403020100LL), top), nib, _mm512_set1_epi8(0x30), 0xEC);
        _mm512_store_si512(Ab + (2*q)*64, _mm512_permutexvar_epi8(ix, tab0));
        _mm512_store_si512(Ab + (2*q+1)*64, _mm512_permutexvar_epi8(ix, tab1));
      }
      _tile_loadd(1, Ab, 64);
      _tile_loadd(2, Bx + p*16*64, 64);
      _tile_dpbusd(0, 1, 2);
    }
    _tile_stored(0, Cout, 12); sink += Cout[0];
  }
  double t = now()-t0; if (t<best) best=t;
  fprintf(stderr, "%ld\n", sink);
  }
  double bytes = (double)(R/2)*rowpair_bytes;
  printf("1 thread: %.2f ms, %.2f GB/s of index data\n", best*1e3, bytes/best/1e9);
  return 0;
}
