"""Count each backward-branch loop's instructions (and their kinds) in one kernel of a cubin."""
import subprocess, re, sys, collections
nd = str(__import__('pathlib').Path(sys.prefix) / 'lib/python3.11/site-packages/nvidia/cu13/bin/nvdisasm')
cubin, kern = sys.argv[1], sys.argv[2]
out = subprocess.run([nd, '-c', cubin], capture_output=True, text=True).stdout
parts = re.split(r'//-+ \.text\.(\S+)\s+-+', out)
for i in range(1, len(parts), 2):
    if parts[i] != kern: continue
    body = parts[i + 1]
    labels, ins = {}, []
    for l in body.split('\n'):
        m = re.match(r'\s*(\.L_x_\d+):', l)
        if m: labels[m[1]] = len(ins); continue
        m = re.search(r'/\*([0-9a-f]{4,})\*/\s+(.*?);', l)
        if m: ins.append((int(m[1], 16), m[2]))
    print(kern, 'instructions', len(ins))
    for j, (a, t) in enumerate(ins):
        m = re.search(r'BRA\s+`\((\.L_x_\d+)\)', t)
        if m and labels.get(m[1], 1 << 30) < j:
            s = labels[m[1]]
            body_ins = ins[s:j + 1]
            kinds = collections.Counter(re.sub(r'^@!?U?P\w+\s+', '', x).split()[0].split('.')[0] for _, x in body_ins)
            print(f'loop {ins[s][0]:#x}-{a:#x}: {len(body_ins)}', dict(kinds.most_common(14)))
