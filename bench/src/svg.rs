//! The chart, written as SVG by hand: per placement, one row of panels —
//! request/response latency percentiles, fixed-rate latency percentiles
//! (log scale), request and connection rates, stream throughput — with one
//! group of horizontal bars per path.

use std::fmt::Write as _;

use crate::{
    model::{Mode, PathSpec, Placement, RunResults},
    report::{Index, Pick, human, path_label, pick_p50, pick_p90, pick_p99, pick_rate},
};

const LABEL_W: f64 = 275.0;
const PANEL_W: f64 = 215.0;
const PANEL_GAP: f64 = 40.0;
const PANELS: f64 = 5.0;
const BAR_H: f64 = 5.0;
const ROW_GAP: f64 = 8.0;
const TOP: f64 = 70.0;

struct Series {
    name: &'static str,
    color: &'static str,
    values: Vec<Option<f64>>,
}

struct Panel {
    title: String,
    log: bool,
    series: Vec<Series>,
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn mode_color(mode: Mode) -> &'static str {
    match mode {
        Mode::Direct => "#555555",
        Mode::Iptables => "#c05000",
        Mode::Ebpf => "#0057b8",
        Mode::EbpfSplice => "#009e73",
        Mode::EbpfFastPath => "#8e44ad",
        Mode::Ztunnel => "#7f6000",
    }
}

const PCT_COLORS: [&str; 4] = ["#1b9e77", "#7570b3", "#d95f02", "#e7298a"];

fn latency_panel(index: &Index, placement: Placement, workload: &str, title: &str) -> Panel {
    let paths = &index.results.paths;
    let stat = |pick: Pick| -> Vec<Option<f64>> {
        paths
            .iter()
            .map(|&p| index.stat(placement, workload, p, pick).map(|s| s.median))
            .collect()
    };
    let p999 = paths
        .iter()
        .map(|&p| index.pooled(placement, workload, p, 0.999))
        .collect();
    Panel {
        title: title.to_string(),
        log: true,
        series: vec![
            Series {
                name: "p50",
                color: PCT_COLORS[0],
                values: stat(pick_p50),
            },
            Series {
                name: "p90",
                color: PCT_COLORS[1],
                values: stat(pick_p90),
            },
            Series {
                name: "p99",
                color: PCT_COLORS[2],
                values: stat(pick_p99),
            },
            Series {
                name: "p99.9",
                color: PCT_COLORS[3],
                values: p999,
            },
        ],
    }
}

fn rate_panel(title: &str, color: &'static str, values: Vec<Option<f64>>) -> Panel {
    Panel {
        title: title.into(),
        log: false,
        series: vec![Series {
            name: "median",
            color,
            values,
        }],
    }
}

fn rate_series(
    index: &Index,
    placement: Placement,
    paths: &[PathSpec],
    workload: &str,
) -> Vec<Option<f64>> {
    paths
        .iter()
        .map(|&p| {
            index
                .stat(placement, workload, p, pick_rate)
                .map(|s| s.median)
        })
        .collect()
}

pub fn chart(results: &RunResults) -> String {
    let index = Index::new(results);
    let paths = &results.paths;
    let row_h = paths.len() as f64 * (4.0 * BAR_H + ROW_GAP) + 40.0;
    let width = LABEL_W + PANELS * (PANEL_W + PANEL_GAP) + 10.0;
    let height = TOP + results.placements.len() as f64 * (row_h + 50.0) + 20.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="11">"##
    );
    let _ = writeln!(
        svg,
        r##"<rect width="100%" height="100%" fill="white"/><text x="10" y="22" font-size="15" font-weight="bold">shunt: latency and throughput per path ({}{}, commit {}, median of {} repetition(s))</text>"##,
        escape(&results.machine.kernel),
        if results.quick {
            ", QUICK smoke run"
        } else {
            ""
        },
        escape(&results.machine.commit),
        results.reps
    );
    let _ = writeln!(
        svg,
        r##"<text x="10" y="40" fill="#444">Latency panels: log scale, µs (p99.9 pooled over repetitions). Colours of path names: direct grey, iptables orange, eBPF (splice off) blue, eBPF+splice green.</text>"##
    );
    // Legend.
    let mut lx = 10.0;
    for (name, color) in ["p50", "p90", "p99", "p99.9"].iter().zip(PCT_COLORS) {
        let _ = writeln!(
            svg,
            r##"<rect x="{lx}" y="50" width="12" height="8" fill="{color}"/><text x="{}" y="58">{name}</text>"##,
            lx + 16.0
        );
        lx += 60.0;
    }
    let _ = lx;

    let mut y0 = TOP;
    for &placement in &results.placements {
        let title = match placement {
            Placement::Pinned => format!("all pinned to CPU {}", results.pin_cpu),
            Placement::Scheduler => "scheduler's choice".to_string(),
        };
        let _ = writeln!(
            svg,
            r##"<text x="10" y="{}" font-size="13" font-weight="bold">{}</text>"##,
            y0 + 14.0,
            escape(&title)
        );
        let panels = [
            latency_panel(&index, placement, "rr1", "RR 1 B latency (µs)"),
            latency_panel(
                &index,
                placement,
                "rate",
                "1000 req/s × 16 conns latency (µs)",
            ),
            rate_panel(
                "RR 1 B req/s",
                "#1f77b4",
                rate_series(&index, placement, paths, "rr1"),
            ),
            rate_panel(
                "new connections/s",
                "#ff7f0e",
                rate_series(&index, placement, paths, "crr"),
            ),
            rate_panel(
                "stream Gbit/s",
                "#2ca02c",
                rate_series(&index, placement, paths, "stream"),
            ),
        ];
        let plot_top = y0 + 36.0;
        // Path labels.
        for (i, path) in paths.iter().enumerate() {
            let y = plot_top + i as f64 * (4.0 * BAR_H + ROW_GAP) + 2.0 * BAR_H + 4.0;
            let _ = writeln!(
                svg,
                r##"<text x="{}" y="{y:.1}" text-anchor="end" fill="{}">{}</text>"##,
                LABEL_W - 8.0,
                mode_color(path.mode),
                escape(&path_label(path))
            );
        }
        for (pi, panel) in panels.iter().enumerate() {
            let x0 = LABEL_W + pi as f64 * (PANEL_W + PANEL_GAP);
            draw_panel(&mut svg, panel, x0, y0 + 28.0, plot_top, paths.len());
        }
        y0 += row_h + 50.0;
    }
    svg.push_str("</svg>\n");
    svg
}

fn draw_panel(svg: &mut String, panel: &Panel, x0: f64, title_y: f64, top: f64, rows: usize) {
    let _ = writeln!(
        svg,
        r##"<text x="{x0}" y="{title_y:.1}" font-weight="bold">{}</text>"##,
        escape(&panel.title)
    );
    let values: Vec<f64> = panel
        .series
        .iter()
        .flat_map(|s| s.values.iter().flatten().copied())
        .filter(|v| *v > 0.0 && v.is_finite())
        .collect();
    let bottom = top + rows as f64 * (4.0 * BAR_H + ROW_GAP);
    let _ = writeln!(
        svg,
        "<rect x=\"{x0}\" y=\"{top:.1}\" width=\"{PANEL_W}\" height=\"{:.1}\" fill=\"#fafafa\" stroke=\"#cccccc\"/>",
        bottom - top
    );
    if values.is_empty() {
        return;
    }
    let max = values.iter().copied().fold(0.0, f64::max);
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let scale: Box<dyn Fn(f64) -> f64> = if panel.log {
        let lo = 10f64.powf(min.log10().floor());
        let hi = 10f64.powf(max.log10().ceil()).max(lo * 10.0);
        let (llo, lhi) = (lo.log10(), hi.log10());
        // Decade ticks.
        let mut t = lo;
        for _ in 0..12 {
            if t > hi * 1.001 {
                break;
            }
            let x = x0 + (t.log10() - llo) / (lhi - llo) * PANEL_W;
            let _ = writeln!(
                svg,
                "<line x1=\"{x:.1}\" y1=\"{top:.1}\" x2=\"{x:.1}\" y2=\"{bottom:.1}\" stroke=\"#dddddd\"/><text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#666666\">{}</text>",
                bottom + 12.0,
                tick(t)
            );
            t *= 10.0;
        }
        Box::new(move |v: f64| ((v.max(lo).log10() - llo) / (lhi - llo) * PANEL_W).max(1.0))
    } else {
        let hi = nice_ceiling(max);
        for i in 0..=4 {
            let t = hi * i as f64 / 4.0;
            let x = x0 + t / hi * PANEL_W;
            let _ = writeln!(
                svg,
                "<line x1=\"{x:.1}\" y1=\"{top:.1}\" x2=\"{x:.1}\" y2=\"{bottom:.1}\" stroke=\"#dddddd\"/><text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#666666\">{}</text>",
                bottom + 12.0,
                tick(t)
            );
        }
        Box::new(move |v: f64| (v / hi * PANEL_W).max(1.0))
    };
    let n = panel.series.len() as f64;
    let bar_h = (4.0 * BAR_H / n).min(8.0);
    for row in 0..rows {
        let row_top = top + row as f64 * (4.0 * BAR_H + ROW_GAP) + ROW_GAP / 2.0;
        for (si, series) in panel.series.iter().enumerate() {
            let Some(Some(v)) = series.values.get(row) else {
                continue;
            };
            let y = row_top + si as f64 * bar_h;
            let w = scale(*v);
            let _ = writeln!(
                svg,
                r##"<rect x="{x0}" y="{y:.1}" width="{w:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"##,
                bar_h - 0.5,
                series.color,
                series.name,
                human(*v)
            );
        }
        // The largest series value as text at the end of the group.
        if panel.series.len() <= 2
            && let Some(Some(v)) = panel.series[0].values.get(row)
        {
            let w = scale(*v);
            let _ = writeln!(
                svg,
                "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"9\" fill=\"#333333\">{}</text>",
                x0 + w + 3.0,
                row_top + bar_h,
                human(*v)
            );
        }
    }
}

/// Axis labels: 1, 10, 100, 1k, 2.5k, 25k, 1M.
fn tick(v: f64) -> String {
    let trim = |x: f64| {
        let s = format!("{x:.1}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    };
    if v >= 1e6 {
        format!("{}M", trim(v / 1e6))
    } else if v >= 1e3 {
        format!("{}k", trim(v / 1e3))
    } else {
        trim(v)
    }
}

fn nice_ceiling(x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(x.log10().floor());
    for step in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if step * magnitude >= x {
            return step * magnitude;
        }
    }
    10.0 * magnitude
}
