#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
int main(void){
  const long N=120000000;
  for(int rep=0;rep<3;rep++){
#define DI(i) __m512i a##i=_mm512_set1_epi32(i);
#define DF(i) __m512 f##i=_mm512_set1_ps(i);
  R12(DI) R12(DF)
  __m512i w=_mm512_set1_epi8(3), x=_mm512_set1_epi8(5), y=_mm512_set1_epi8(7);
  __m512 fw=_mm512_set1_ps(0.5f), fx=_mm512_set1_ps(1.0f);
  double t0=now();
#define OP1(i) a##i=_mm512_dpbusd_epi32(a##i,w,x);
  for(long n=0;n<N;n++){ R12(OP1) __asm__ volatile("" : "+v"(w), "+v"(x)); }
  double t1=now();
#define OP2(i) f##i=_mm512_fmadd_ps(f##i,fw,fx);
  for(long n=0;n<N;n++){ R12(OP2) __asm__ volatile("" : "+v"(fw), "+v"(fx)); }
  double t2=now();
#define OP3(i) a##i=_mm512_permutexvar_epi8(y,a##i);
  for(long n=0;n<N;n++){ R12(OP3) __asm__ volatile("" : "+v"(y)); }
  double t3=now();
#define OP4(i) a##i=_mm512_dpbusd_epi32(a##i,w,_mm512_permutexvar_epi8(a##i,y));
  for(long n=0;n<N;n++){ R12(OP1) OP3(0) OP3(1) OP3(2) OP3(3) OP3(4) OP3(5) __asm__ volatile("" : "+v"(w), "+v"(x), "+v"(y)); }
  double t4=now();
  __m512i s=_mm512_setzero_si512(); __m512 fs=_mm512_setzero_ps();
#define SI(i) s=_mm512_add_epi32(s,a##i); fs=_mm512_add_ps(fs,f##i);
  R12(SI)
  double M=12.0*N/1e9;
  printf("instr/s: vpdpbusd %.2f G, vfmadd %.2f G, vpermb %.2f G, 12 dpbusd+6 vpermb: %.2f G (%d %g)\n",M/(t1-t0),M/(t2-t1),M/(t3-t2),1.5*M/(t4-t3),_mm512_reduce_add_epi32(s),_mm512_reduce_add_ps(fs));
  }
}
