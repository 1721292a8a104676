// AMX probe (ninth session): is AMX usable here, and what does one tdpbusd cost?
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <time.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
typedef struct { uint8_t palette_id, start_row, r[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;
static double now(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9; }
int main(){
  long r = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
  printf("arch_prctl -> %ld\n", r); if (r) return 1;
  cfg_t c; memset(&c,0,sizeof c); c.palette_id=1;
  for (int i=0;i<8;i++){ c.colsb[i]=64; c.rows[i]=16; }
  _tile_loadconfig(&c);
  static uint8_t A[16*64] __attribute__((aligned(64))); static int8_t B[16*64] __attribute__((aligned(64))); static int32_t C[16*16] __attribute__((aligned(64)));
  for (int i=0;i<1024;i++){ A[i]=i*7; B[i]=(int8_t)(i*13); }
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, A, 64); _tile_loadd(5, B, 64);
  long n = 20000000; double t0=now();
  for (long i=0;i<n;i++){ _tile_dpbusd(0,4,5); _tile_dpbusd(1,4,5); _tile_dpbusd(2,4,5); _tile_dpbusd(3,4,5); }
  double t1=now();
  _tile_stored(0, C, 64);
  printf("tdpbusd: %.2f ns each (%.1f GMAC/s)  C[0]=%d\n", (t1-t0)/(4.0*n)*1e9, 4.0*n*16*16*64/(t1-t0)/1e9, C[0]);
  // check correctness of one tile op vs scalar
  _tile_zero(0); _tile_dpbusd(0,4,5); _tile_stored(0,C,64);
  long bad=0; for(int m=0;m<16;m++) for(int nn=0;nn<16;nn++){ int32_t s=0; for(int k=0;k<64;k++) s += (int32_t)A[m*64+k]*(int32_t)B[(k/4)*64+nn*4+k%4]; if(s!=C[m*16+nn]) bad++; }
  printf("mismatches %ld\n", bad);
  // tile load of A from L1 each time + dpbusd with small N (3 columns)
  _tile_release(); return 0;
}
