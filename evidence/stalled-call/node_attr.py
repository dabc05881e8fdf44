import json, sys
d=json.load(open(sys.argv[1]+'/sliced.json')); w=[x for x in d['windows'] if x[0]=='node']
a=w[0][4]; b=w[-1][4]
dd={k: round(b[k]-a[k],3) for k in a}
print(dd)
print("decode rows/decode call", round(dd["decode_rows_total"]/dd["decode_batches_total"],2))
for x in w: print(x[1], {k: x[4][k] for k in ("decode_batches_total","decode_rows_total","decode_halved_total")})
