// Throughput of AVX2 instruction kinds alone and in pairs of kinds: eight independent chains
// (a_i = op(a_i, k), k opaque to the compiler), four times unrolled; cycles per eight
// instructions at 2.9 GHz. gcc -O2 -mavx2 -mfma ports_probe.c && ./a.out
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec a; clock_gettime(CLOCK_MONOTONIC,&a); return a.tv_sec+a.tv_nsec*1e-9;}
#define N 100000000
#define T(name, body) { __m256i a0=_mm256_set1_epi8(1),a1=_mm256_set1_epi8(2),a2=_mm256_set1_epi8(3),a3=_mm256_set1_epi8(4),a4=_mm256_set1_epi8(5),a5=_mm256_set1_epi8(6),a6=_mm256_set1_epi8(7),a7=_mm256_set1_epi8(8), k=_mm256_set1_epi8(9); __asm__ volatile("" : "+x"(k)); double t=now(); for(long i=0;i<N;i++){ body; body; body; body; __asm__ volatile("" : "+x"(a0),"+x"(a1),"+x"(a2),"+x"(a3),"+x"(a4),"+x"(a5),"+x"(a6),"+x"(a7)); } t=now()-t; __m256i s=_mm256_add_epi8(_mm256_add_epi8(a0,a1),_mm256_add_epi8(a2,a3)); s=_mm256_add_epi8(s,_mm256_add_epi8(_mm256_add_epi8(a4,a5),_mm256_add_epi8(a6,a7))); printf("%-28s %.3f cycles/8ops@2.9GHz  (%d)\n", name, t/N/4*1e9*2.9, _mm256_extract_epi8(s,0)); }
int main(){

 T("8 pshufb", a0=_mm256_shuffle_epi8(a0,k);a1=_mm256_shuffle_epi8(a1,k);a2=_mm256_shuffle_epi8(a2,k);a3=_mm256_shuffle_epi8(a3,k);a4=_mm256_shuffle_epi8(a4,k);a5=_mm256_shuffle_epi8(a5,k);a6=_mm256_shuffle_epi8(a6,k);a7=_mm256_shuffle_epi8(a7,k))
 T("8 madd", a0=_mm256_madd_epi16(a0,k);a1=_mm256_madd_epi16(a1,k);a2=_mm256_madd_epi16(a2,k);a3=_mm256_madd_epi16(a3,k);a4=_mm256_madd_epi16(a4,k);a5=_mm256_madd_epi16(a5,k);a6=_mm256_madd_epi16(a6,k);a7=_mm256_madd_epi16(a7,k))
 T("4 pshufb+4 madd", a0=_mm256_shuffle_epi8(a0,k);a1=_mm256_madd_epi16(a1,k);a2=_mm256_shuffle_epi8(a2,k);a3=_mm256_madd_epi16(a3,k);a4=_mm256_shuffle_epi8(a4,k);a5=_mm256_madd_epi16(a5,k);a6=_mm256_shuffle_epi8(a6,k);a7=_mm256_madd_epi16(a7,k))
 T("4 unpack+4 madd", a0=_mm256_unpacklo_epi8(a0,k);a1=_mm256_madd_epi16(a1,k);a2=_mm256_unpackhi_epi8(a2,k);a3=_mm256_madd_epi16(a3,k);a4=_mm256_unpacklo_epi8(a4,k);a5=_mm256_madd_epi16(a5,k);a6=_mm256_unpackhi_epi8(a6,k);a7=_mm256_madd_epi16(a7,k))
 T("8 blendv", a0=_mm256_blendv_epi8(a0,k,a1);a1=_mm256_blendv_epi8(a1,k,a2);a2=_mm256_blendv_epi8(a2,k,a3);a3=_mm256_blendv_epi8(a3,k,a4);a4=_mm256_blendv_epi8(a4,k,a5);a5=_mm256_blendv_epi8(a5,k,a6);a6=_mm256_blendv_epi8(a6,k,a7);a7=_mm256_blendv_epi8(a7,k,a0))
 T("4 blendv+4 pshufb", a0=_mm256_blendv_epi8(a0,k,k);a1=_mm256_shuffle_epi8(a1,k);a2=_mm256_blendv_epi8(a2,k,k);a3=_mm256_shuffle_epi8(a3,k);a4=_mm256_blendv_epi8(a4,k,k);a5=_mm256_shuffle_epi8(a5,k);a6=_mm256_blendv_epi8(a6,k,k);a7=_mm256_shuffle_epi8(a7,k))
 T("4 blendv+4 madd", a0=_mm256_blendv_epi8(a0,k,k);a1=_mm256_madd_epi16(a1,k);a2=_mm256_blendv_epi8(a2,k,k);a3=_mm256_madd_epi16(a3,k);a4=_mm256_blendv_epi8(a4,k,k);a5=_mm256_madd_epi16(a5,k);a6=_mm256_blendv_epi8(a6,k,k);a7=_mm256_madd_epi16(a7,k))
 T("8 maddubs", a0=_mm256_maddubs_epi16(a0,k);a1=_mm256_maddubs_epi16(a1,k);a2=_mm256_maddubs_epi16(a2,k);a3=_mm256_maddubs_epi16(a3,k);a4=_mm256_maddubs_epi16(a4,k);a5=_mm256_maddubs_epi16(a5,k);a6=_mm256_maddubs_epi16(a6,k);a7=_mm256_maddubs_epi16(a7,k))
 T("4 cvtdq2ps+4 madd", a0=_mm256_castps_si256(_mm256_cvtepi32_ps(a0));a1=_mm256_madd_epi16(a1,k);a2=_mm256_castps_si256(_mm256_cvtepi32_ps(a2));a3=_mm256_madd_epi16(a3,k);a4=_mm256_castps_si256(_mm256_cvtepi32_ps(a4));a5=_mm256_madd_epi16(a5,k);a6=_mm256_castps_si256(_mm256_cvtepi32_ps(a6));a7=_mm256_madd_epi16(a7,k))
 T("4 fma+4 madd", a0=_mm256_castps_si256(_mm256_fmadd_ps(_mm256_castsi256_ps(a0),_mm256_castsi256_ps(k),_mm256_castsi256_ps(k)));a1=_mm256_madd_epi16(a1,k);a2=_mm256_castps_si256(_mm256_fmadd_ps(_mm256_castsi256_ps(a2),_mm256_castsi256_ps(k),_mm256_castsi256_ps(k)));a3=_mm256_madd_epi16(a3,k);a4=_mm256_castps_si256(_mm256_fmadd_ps(_mm256_castsi256_ps(a4),_mm256_castsi256_ps(k),_mm256_castsi256_ps(k)));a5=_mm256_madd_epi16(a5,k);a6=_mm256_castps_si256(_mm256_fmadd_ps(_mm256_castsi256_ps(a6),_mm256_castsi256_ps(k),_mm256_castsi256_ps(k)));a7=_mm256_madd_epi16(a7,k))
 T("8 srli16", a0=_mm256_srli_epi16(a0,1);a1=_mm256_srli_epi16(a1,1);a2=_mm256_srli_epi16(a2,1);a3=_mm256_srli_epi16(a3,1);a4=_mm256_srli_epi16(a4,1);a5=_mm256_srli_epi16(a5,1);a6=_mm256_srli_epi16(a6,1);a7=_mm256_srli_epi16(a7,1))
 T("4 srli16+4 pshufb", a0=_mm256_srli_epi16(a0,1);a1=_mm256_shuffle_epi8(a1,k);a2=_mm256_srli_epi16(a2,1);a3=_mm256_shuffle_epi8(a3,k);a4=_mm256_srli_epi16(a4,1);a5=_mm256_shuffle_epi8(a5,k);a6=_mm256_srli_epi16(a6,1);a7=_mm256_shuffle_epi8(a7,k))
 T("4 srli16+4 madd", a0=_mm256_srli_epi16(a0,1);a1=_mm256_madd_epi16(a1,k);a2=_mm256_srli_epi16(a2,1);a3=_mm256_madd_epi16(a3,k);a4=_mm256_srli_epi16(a4,1);a5=_mm256_madd_epi16(a5,k);a6=_mm256_srli_epi16(a6,1);a7=_mm256_madd_epi16(a7,k))
 T("8 srlv", a0=_mm256_srlv_epi32(a0,k);a1=_mm256_srlv_epi32(a1,k);a2=_mm256_srlv_epi32(a2,k);a3=_mm256_srlv_epi32(a3,k);a4=_mm256_srlv_epi32(a4,k);a5=_mm256_srlv_epi32(a5,k);a6=_mm256_srlv_epi32(a6,k);a7=_mm256_srlv_epi32(a7,k))
 T("4 srlv+4 pshufb", a0=_mm256_srlv_epi32(a0,k);a1=_mm256_shuffle_epi8(a1,k);a2=_mm256_srlv_epi32(a2,k);a3=_mm256_shuffle_epi8(a3,k);a4=_mm256_srlv_epi32(a4,k);a5=_mm256_shuffle_epi8(a5,k);a6=_mm256_srlv_epi32(a6,k);a7=_mm256_shuffle_epi8(a7,k))
 T("4 srlv+4 madd", a0=_mm256_srlv_epi32(a0,k);a1=_mm256_madd_epi16(a1,k);a2=_mm256_srlv_epi32(a2,k);a3=_mm256_madd_epi16(a3,k);a4=_mm256_srlv_epi32(a4,k);a5=_mm256_madd_epi16(a5,k);a6=_mm256_srlv_epi32(a6,k);a7=_mm256_madd_epi16(a7,k))
 T("2 madd+2pshufb+4 srli16", a0=_mm256_srli_epi16(a0,1);a1=_mm256_madd_epi16(a1,k);a2=_mm256_srli_epi16(a2,1);a3=_mm256_shuffle_epi8(a3,k);a4=_mm256_srli_epi16(a4,1);a5=_mm256_madd_epi16(a5,k);a6=_mm256_srli_epi16(a6,1);a7=_mm256_shuffle_epi8(a7,k))
 T("4 slli32+4 madd", a0=_mm256_slli_epi32(a0,1);a1=_mm256_madd_epi16(a1,k);a2=_mm256_slli_epi32(a2,1);a3=_mm256_madd_epi16(a3,k);a4=_mm256_slli_epi32(a4,1);a5=_mm256_madd_epi16(a5,k);a6=_mm256_slli_epi32(a6,1);a7=_mm256_madd_epi16(a7,k))
 T("4 maddubs+4 madd", a0=_mm256_maddubs_epi16(a0,k);a1=_mm256_madd_epi16(a1,k);a2=_mm256_maddubs_epi16(a2,k);a3=_mm256_madd_epi16(a3,k);a4=_mm256_maddubs_epi16(a4,k);a5=_mm256_madd_epi16(a5,k);a6=_mm256_maddubs_epi16(a6,k);a7=_mm256_madd_epi16(a7,k))

 { // The clock: a chain of dependent adds, one per cycle.
   unsigned long x = 1; double t = now();
   for (long i = 0; i < N; i++) { __asm__ volatile("add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0" : "+r"(x)); }
   t = now() - t; printf("clock %.2f GHz (%lu)\n", 8.0 * N / t / 1e9, x & 1); }
 return 0; }
