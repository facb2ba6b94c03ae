//! SVG plots of load results, written by hand (no plotting dependency): time-to-first-token
//! CDFs, one line per run.

use std::fmt::Write;

const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 12] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#000000", "#aec7e8",
];

/// CDF of each series' values (milliseconds), x on a log scale.
pub fn cdf_svg(title: &str, series: &[(String, Vec<f64>)]) -> String {
    let all: Vec<f64> = series.iter().flat_map(|(_, v)| v.iter().copied()).filter(|v| *v > 0.0).collect();
    let lo = all.iter().cloned().fold(f64::INFINITY, f64::min).max(0.1);
    let hi = all.iter().cloned().fold(0.0, f64::max).max(lo * 10.0);
    let (lx, hx) = (lo.log10().floor(), hi.log10().ceil());
    let x = |v: f64| LEFT + (v.max(lo).log10() - lx) / (hx - lx) * (W - LEFT - RIGHT);
    let y = |p: f64| H - BOTTOM - p * (H - TOP - BOTTOM);
    let mut s = String::new();
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"##,
        W / 2.0,
        escape(title)
    );
    // Axes and grid: decades on x, quarters on y.
    let mut d = lx;
    while d <= hx {
        let v = 10f64.powf(d);
        let _ = write!(
            s,
            r##"<line x1="{0:.1}" y1="{1}" x2="{0:.1}" y2="{2}" stroke="#ddd"/><text x="{0:.1}" y="{3}" text-anchor="middle">{4}</text>"##,
            x(v),
            TOP,
            H - BOTTOM,
            H - BOTTOM + 16.0,
            if v >= 1000.0 { format!("{}s", v / 1000.0) } else { format!("{v}ms") }
        );
        d += 1.0;
    }
    for q in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let _ = write!(
            s,
            r##"<line x1="{LEFT}" y1="{0:.1}" x2="{1}" y2="{0:.1}" stroke="#ddd"/><text x="{2}" y="{3:.1}" text-anchor="end">{4}%</text>"##,
            y(q),
            W - RIGHT,
            LEFT - 6.0,
            y(q) + 4.0,
            (q * 100.0) as u32
        );
    }
    let _ = write!(
        s,
        r##"<text x="{}" y="{}" text-anchor="middle">time to first token (log scale)</text><text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">requests</text>"##,
        (LEFT + W - RIGHT) / 2.0,
        H - 16.0,
        H / 2.0,
        H / 2.0
    );
    for (i, (label, values)) in series.iter().enumerate() {
        let mut v = values.clone();
        v.sort_by(f64::total_cmp);
        let color = COLORS[i % COLORS.len()];
        let n = v.len().max(1) as f64;
        let mut pts = String::new();
        for (k, val) in v.iter().enumerate() {
            let _ = write!(pts, "{:.1},{:.1} {:.1},{:.1} ", x(*val), y(k as f64 / n), x(*val), y((k + 1) as f64 / n));
        }
        let _ = write!(s, r##"<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>"##);
        let ly = TOP + 16.0 + i as f64 * 18.0;
        let _ = write!(
            s,
            r##"<line x1="{0}" y1="{1:.1}" x2="{2}" y2="{1:.1}" stroke="{color}" stroke-width="3"/><text x="{3}" y="{4:.1}">{5}</text>"##,
            LEFT + 12.0,
            ly,
            LEFT + 36.0,
            LEFT + 42.0,
            ly + 4.0,
            escape(label)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_one_line_per_series() {
        let svg = cdf_svg("TTFT <test>", &[("a".into(), vec![1.0, 10.0, 100.0]), ("b".into(), vec![50.0])]);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("TTFT &lt;test&gt;") && svg.ends_with("</svg>\n"));
    }
}
