#!/usr/bin/env python3
"""The scale simulation's growth curves as SVG, from `cargo bench --bench scale` output:

    cargo bench -q --bench scale | tee scale.md | python3 benches/scale_plot.py > scale.svg
"""
import math
import sys

rows = []
for line in sys.stdin:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 7 and cells[0].isdigit():
        rows.append((int(cells[0]), int(cells[1]), float(cells[5].split()[0]), float(cells[4])))

W, H, L, B, T, R = 640, 380, 70, 50, 30, 150
xs = [r[1] for r in rows]
x0, x1 = math.log10(min(xs)), math.log10(max(xs))
ymax = max(r[2] for r in rows) * 1.1
x = lambda v: L + (math.log10(v) - x0) / (x1 - x0) * (W - L - R)  # noqa: E731
y = lambda v: H - B - v / ymax * (H - B - T)  # noqa: E731
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">'
       '<rect width="100%" height="100%" fill="white"/>'
       f'<text x="{(W - R) / 2}" y="18" text-anchor="middle" font-size="14">Routing decision + release vs cached entries</text>']
for e in range(int(x0), int(x1) + 1):
    out.append(f'<line x1="{x(10 ** e):.1f}" x2="{x(10 ** e):.1f}" y1="{T}" y2="{H - B}" stroke="#ddd"/>'
               f'<text x="{x(10 ** e):.1f}" y="{H - B + 16}" text-anchor="middle">1e{e}</text>')
step = 10 ** math.floor(math.log10(ymax / 4))
v = 0
while v <= ymax:
    out.append(f'<line x1="{L}" x2="{W - R}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
               f'<text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g} µs</text>')
    v += step * (2 if ymax / step > 10 else 1)
out.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">cached (worker, block) entries</text>')
colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e"]
for i, wk in enumerate(sorted({r[0] for r in rows})):
    pts = [(r[1], r[2]) for r in rows if r[0] == wk]
    c = colors[i % 4]
    out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
               + " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in pts) + '"/>')
    out.append(f'<rect x="{W - R + 10}" y="{T + i * 18}" width="14" height="4" fill="{c}"/>'
               f'<text x="{W - R + 30}" y="{T + i * 18 + 6}">{wk} workers</text>')
out.append("</svg>")
print("".join(out))
