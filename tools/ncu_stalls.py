import csv, sys, collections
path = sys.argv[1]
rows = list(csv.reader(open(path)))
hdr = rows[1]; data = rows[2:]
idx = {h: i for i, h in enumerate(hdr)}
stall_cols = [h for h in hdr if h.startswith('stall_') and '(Not Issued)' not in h]
tot = collections.Counter(); samples = 0
per_instr = []
for r in data:
    if len(r) < len(hdr): continue
    try: s = int(r[idx['Warp Stall Sampling (All Samples)']] or 0)
    except: continue
    samples += s
    for c in stall_cols:
        v = r[idx[c]]
        if v: tot[c] += int(float(v))
    per_instr.append((s, r[idx['Address']], r[idx['Source']], {c: r[idx[c]] for c in stall_cols if r[idx[c]] not in ('', '0')}))
print('samples', samples)
for c, v in tot.most_common(12): print(f'  {c:22s} {v:8d} {100*v/samples:5.1f}%')
per_instr.sort(key=lambda x: -x[0])
for s, a, src, d in per_instr[:25]:
    top = sorted(d.items(), key=lambda kv: -int(float(kv[1])))[:3]
    print(f'{s:6d} {a} {src[:60]:60s} {top}')
