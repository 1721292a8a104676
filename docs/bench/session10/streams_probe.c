#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static uint64_t *buf; static size_t N; static int S;
static void* work(void* arg){ long id=(long)arg; size_t per=N/2; uint64_t* b=buf+id*per; size_t seg=per/S; uint64_t acc=0;
  __m512i a=_mm512_setzero_si512();
  for(size_t i=0;i<seg;i+=8){ for(int s=0;s<S;s++){ const uint64_t* p=b+s*seg+i; _mm_prefetch((const char*)(p+1024),_MM_HINT_T0); a=_mm512_add_epi64(a,_mm512_loadu_si512(p)); } }
  uint64_t o[8]; _mm512_storeu_si512(o,a); acc=o[0]+o[7]; return (void*)acc; }
int main(int argc,char**argv){ N=(1UL<<30)/8; buf=aligned_alloc(64,N*8); for(size_t i=0;i<N;i++) buf[i]=i;
  for(int r=0;r<3;r++) for(S=1;S<=16;S*=2){ double t0=now(); pthread_t th[2]; for(long i=0;i<2;i++) pthread_create(&th[i],0,work,(void*)i); for(int i=0;i<2;i++) pthread_join(th[i],0); printf("streams/thread %d: %.2f GB/s\n",S,N*8/(now()-t0)/1e9); }
}
