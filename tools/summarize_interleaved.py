#!/usr/bin/env python3
"""Means and ratios over the rounds of tools/interleaved_smollm2.sh outputs: python3 tools/summarize_interleaved.py FILE..."""
import sys, collections
lines=[l.split() for f in sys.argv[1:] for l in open(f) if l.startswith(('llama.cpp','forge'))]
rounds=[]; cur={}
for l in lines:
    k=(l[0],l[1])
    if k in cur: rounds.append(cur); cur={}
    cur[k]=(float(l[2]),float(l[3]))
if cur: rounds.append(cur)
keys=[]
for r in rounds:
    for k in r:
        if k not in keys: keys.append(k)
mean=lambda xs: sum(xs)/len(xs)
print(f"{len(rounds)} rounds")
for k in keys:
    pp=[r[k][0] for r in rounds if k in r]; tg=[r[k][1] for r in rounds if k in r]
    print(f"{k[0]:9} {k[1]:16} prefill {mean(pp):6.1f} decode {mean(tg):6.1f}")
ll=[k for k in keys if k[0]=='llama.cpp']; fo=[k for k in keys if k[0]=='forge']
for f in fo:
    row=[f[1]]
    for l,idx,lab in [(x,i,('pp/','tg/')[i]+x[1]) for x in ll for i in (0,1)]:
        rs=[r[f][idx]/r[l][idx] for r in rounds if f in r and l in r]
        m=mean([r[f][idx] for r in rounds if f in r])/mean([r[l][idx] for r in rounds if l in r])
        rs.sort()
        row.append(f"{lab} {m:.2f} ({rs[0]:.2f}-{rs[-1]:.2f}, med {rs[len(rs)//2]:.2f})")
    print(" | ".join(row))
