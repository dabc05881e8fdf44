import json, sys
d=json.load(open('sliced.json')); w=[x for x in d['windows'] if x[0]=='bare']
log=json.load(open('bare.calls.json'))
act=0; dcalls=0; drows=0; ddec=0; pcalls=0; prows=0; pdec=0
for i,(n,r,t0,t1,_) in enumerate(w):
    if i==0: continue
    act+=t1-t0
    for t_end,dt,nr,pre in log:
        if t0<=t_end<t1:
            if t_end-dt < t0: dt-= t0-w[i-1][3]
            if pre: pcalls+=1; prows+=nr; pdec+=dt
            else: dcalls+=1; drows+=nr; ddec+=dt
print(f"bare: active {act:.1f}s in-decode {(ddec+pdec)/act:.3f}  decode calls {dcalls} rows/call {drows/dcalls:.2f} ms/call {1000*ddec/dcalls:.1f}  prefill calls {pcalls} ms {1000*pdec/max(pcalls,1):.1f}; calls/s {(dcalls+pcalls)/act:.3f}")
