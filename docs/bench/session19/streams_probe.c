#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static char* buf; static size_t N; static int S, PF;
typedef struct {int id; long long sum;} A;
static void* work(void* p){A*a=p; size_t per=N/2; char* base=buf+a->id*per; size_t seg=per/S & ~63UL;
  __m512i acc=_mm512_setzero_si512();
  for(size_t i=0;i<seg;i+=64){ for(int s=0;s<S;s++){ char* q=base+s*seg+i; if(PF) _mm_prefetch(q+PF,_MM_HINT_T0); acc=_mm512_add_epi64(acc,_mm512_load_si512(q)); } }
  a->sum=_mm512_reduce_add_epi64(acc); return 0;}
int main(int c,char**v){ N=(size_t)2<<30; buf=aligned_alloc(64,N); memset(buf,1,N);
 int ss[]={1,2,4,8}; int pfs[]={0,4096,8192};
 for(int rep=0;rep<2;rep++) for(int k=0;k<4;k++) for(int j=0;j<3;j++){ S=ss[k]; PF=pfs[j]; pthread_t t[2]; A a[2]; double t0=now();
  for(int i=0;i<2;i++){a[i].id=i; pthread_create(&t[i],0,work,&a[i]);} for(int i=0;i<2;i++) pthread_join(t[i],0);
  printf("streams %d pf %5d: %.1f GB/s\n",S,PF,N/(now()-t0)/1e9);} }
