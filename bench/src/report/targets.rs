//! The verdict: each target (eBPF+proxy against a baseline, for a metric of
//! a workload) judged on the median of the ratios paired per repetition,
//! and the tables that show it (✅ met, ❌ missed).

use std::fmt::Write as _;

use super::stats::{Index, Pick, Stat, pick_p99, pick_rate};
use crate::model::{Dest, Locality, Mode, PathSpec, Placement};

/// A target: eBPF+proxy against a baseline, for a metric of a workload.
pub struct Target {
    pub what: &'static str,
    pub workload: &'static str,
    pub pick: Pick,
    pub against: Mode,
    /// Ratio bound, and whether the ratio must be at least (true) or at most it.
    pub bound: f64,
    pub at_least: bool,
}

impl Target {
    /// Whether a (median) ratio meets the target; the bound itself does.
    pub fn met(&self, ratio: f64) -> bool {
        if self.at_least {
            ratio >= self.bound
        } else {
            ratio <= self.bound
        }
    }
}

pub fn targets() -> Vec<Target> {
    vec![
        Target {
            what: "connections/s",
            workload: "crr",
            pick: pick_rate,
            against: Mode::Iptables,
            bound: 1.5,
            at_least: true,
        },
        Target {
            what: "request/response rate (1 B)",
            workload: "rr1",
            pick: pick_rate,
            against: Mode::Iptables,
            bound: 1.4,
            at_least: true,
        },
        Target {
            what: "request/response p99 (1 B)",
            workload: "rr1",
            pick: pick_p99,
            against: Mode::Iptables,
            bound: 0.75,
            at_least: false,
        },
        Target {
            what: "stream throughput",
            workload: "stream",
            pick: pick_rate,
            against: Mode::Iptables,
            bound: 1.5,
            at_least: true,
        },
        Target {
            what: "request/response rate (1 B)",
            workload: "rr1",
            pick: pick_rate,
            against: Mode::Direct,
            bound: 0.6,
            at_least: true,
        },
        Target {
            what: "connections/s",
            workload: "crr",
            pick: pick_rate,
            against: Mode::Direct,
            bound: 0.6,
            at_least: true,
        },
        Target {
            what: "stream throughput",
            workload: "stream",
            pick: pick_rate,
            against: Mode::Direct,
            bound: 0.7,
            at_least: true,
        },
    ]
}

pub(super) fn baseline_of(path: PathSpec, against: Mode) -> PathSpec {
    match against {
        Mode::Direct => PathSpec {
            mode: Mode::Direct,
            locality: path.locality,
            dest: Dest::Plain,
        },
        mode => PathSpec { mode, ..path },
    }
}

fn mesh_variants() -> Vec<(Locality, Dest)> {
    vec![
        (Locality::Same, Dest::Plain),
        (Locality::Same, Dest::Hbone),
        (Locality::Cross, Dest::Plain),
        (Locality::Cross, Dest::Hbone),
    ]
}

fn variant_label(l: Locality, d: Dest) -> &'static str {
    match (l, d) {
        (Locality::Same, Dest::Plain) => "same node, passthrough",
        (Locality::Same, Dest::Hbone) => "same node, HBONE",
        (Locality::Cross, Dest::Plain) => "cross node, passthrough",
        (Locality::Cross, Dest::Hbone) => "cross node, HBONE",
    }
}

/// How one target fares per variant for `mode` (eBPF with splice off or
/// on): (ratio, met?) cells.
pub fn target_cells(
    index: &Index,
    placement: Placement,
    mode: Mode,
    t: &Target,
) -> Vec<Option<(Stat, bool)>> {
    mesh_variants()
        .into_iter()
        .map(|(locality, dest)| {
            let path = PathSpec {
                mode,
                locality,
                dest,
            };
            if !index.results.paths.contains(&path)
                || !index.results.paths.contains(&baseline_of(path, t.against))
            {
                return None;
            }
            let s = index.ratio(
                placement,
                t.workload,
                path,
                baseline_of(path, t.against),
                t.pick,
            )?;
            Some((s, t.met(s.median)))
        })
        .collect()
}

pub fn ratio_cell(cell: &Option<(Stat, bool)>) -> String {
    match cell {
        None => "–".into(),
        Some((s, met)) => {
            let mark = if *met { "✅" } else { "❌" };
            if s.n > 1 {
                format!("{mark} {:.2}× ({:.2}–{:.2})", s.median, s.min, s.max)
            } else {
                format!("{mark} {:.2}×", s.median)
            }
        }
    }
}

/// The targets for eBPF with splice off and, where measured, on; then
/// the fast path's (issue 18), where measured.
pub fn targets_table(index: &Index, placement: Placement) -> String {
    let mut md = String::new();
    for mode in [Mode::Ebpf, Mode::EbpfSplice] {
        if index.results.paths.iter().any(|p| p.mode == mode) {
            if !md.is_empty() {
                md.push('\n');
            }
            md.push_str(&mode_targets_table(index, placement, mode));
        }
    }
    if index
        .results
        .paths
        .iter()
        .any(|p| p.mode == Mode::EbpfFastPath)
    {
        if !md.is_empty() {
            md.push('\n');
        }
        md.push_str(&fast_path_targets_table(index, placement));
        md.push('\n');
        md.push_str(&fast_path_mesh_targets_table(index, placement));
    }
    md
}

/// The same-node mesh fast path's targets (issue 18, flow 2): against
/// direct, and against iptables+proxy on the same (HBONE) path.
pub fn fast_path_mesh_targets() -> Vec<Target> {
    let t = |what, workload, against, bound| Target {
        what,
        workload,
        pick: pick_rate,
        against,
        bound,
        at_least: true,
    };
    vec![
        t("request/response rate (1 B)", "rr1", Mode::Direct, 0.85),
        t("connections/s", "crr", Mode::Direct, 0.75),
        t("stream throughput", "stream", Mode::Direct, 0.85),
        t("request/response rate (1 B)", "rr1", Mode::Iptables, 1.5),
        t("connections/s", "crr", Mode::Iptables, 1.5),
        t("stream throughput", "stream", Mode::Iptables, 1.5),
    ]
}

fn fast_path_mesh_targets_table(index: &Index, placement: Placement) -> String {
    let mut md = String::from(
        "| eBPF+fast path vs | metric | target | same node, mesh in the kernel |\n|---|---|--:|--:|\n",
    );
    for t in fast_path_mesh_targets() {
        let against = match t.against {
            Mode::Direct => "direct",
            _ => "iptables+proxy (HBONE)",
        };
        let _ = write!(md, "| {against} | {} | ≥ {:.2}× |", t.what, t.bound);
        let cells = target_cells(index, placement, Mode::EbpfFastPath, &t);
        // mesh_variants(): same/hbone is second.
        let _ = writeln!(md, " {} |", ratio_cell(&cells[1]));
    }
    md
}

/// The passthrough fast path's targets (issue 18): against direct, and
/// against iptables+proxy, on the passthrough paths.
pub fn fast_path_targets() -> Vec<Target> {
    let t = |what, workload, against, bound| Target {
        what,
        workload,
        pick: pick_rate,
        against,
        bound,
        at_least: true,
    };
    vec![
        t("request/response rate (1 B)", "rr1", Mode::Direct, 0.9),
        t("connections/s", "crr", Mode::Direct, 0.8),
        t("stream throughput", "stream", Mode::Direct, 0.9),
        t("request/response rate (1 B)", "rr1", Mode::Iptables, 1.5),
        t("connections/s", "crr", Mode::Iptables, 1.5),
        t("stream throughput", "stream", Mode::Iptables, 1.5),
    ]
}

fn fast_path_targets_table(index: &Index, placement: Placement) -> String {
    let mut md = String::from(
        "| eBPF+fast path vs | metric | target | same node, passthrough | cross node, passthrough |\n|---|---|--:|--:|--:|\n",
    );
    for t in fast_path_targets() {
        let against = match t.against {
            Mode::Direct => "direct",
            _ => "iptables+proxy",
        };
        let _ = write!(md, "| {against} | {} | ≥ {:.2}× |", t.what, t.bound);
        let cells = target_cells(index, placement, Mode::EbpfFastPath, &t);
        // mesh_variants(): same/plain is first, cross/plain third.
        for i in [0, 2] {
            let _ = write!(md, " {} |", ratio_cell(&cells[i]));
        }
        md.push('\n');
    }
    md
}

fn mode_targets_table(index: &Index, placement: Placement, mode: Mode) -> String {
    let mut md = String::new();
    let label = match mode {
        Mode::EbpfSplice => "eBPF+proxy+splice",
        _ => "eBPF+proxy (splice off)",
    };
    let _ = write!(md, "| {label} vs | metric | target |");
    for (l, d) in mesh_variants() {
        let _ = write!(md, " {} |", variant_label(l, d));
    }
    md.push_str("\n|---|---|--:|--:|--:|--:|--:|\n");
    for t in targets() {
        let against = match t.against {
            Mode::Direct => "direct",
            _ => "iptables+proxy",
        };
        let bound = if t.at_least {
            format!("≥ {:.2}×", t.bound)
        } else {
            format!("≤ {:.2}×", t.bound)
        };
        let _ = write!(md, "| {against} | {} | {bound} |", t.what);
        for cell in target_cells(index, placement, mode, &t) {
            let _ = write!(md, " {} |", ratio_cell(&cell));
        }
        md.push('\n');
    }
    md
}

/// iptables+proxy against direct, for reference (no target).
pub fn iptables_vs_direct_table(index: &Index, placement: Placement) -> String {
    let mut md = String::new();
    md.push_str("| iptables+proxy vs direct | ");
    for (l, d) in mesh_variants() {
        let _ = write!(md, " {} |", variant_label(l, d));
    }
    md.push_str("\n|---|--:|--:|--:|--:|\n");
    let rows: [(&str, &str, Pick); 4] = [
        ("RR 1 B req/s", "rr1", pick_rate),
        ("RR 1 B p99", "rr1", pick_p99),
        ("conn/s", "crr", pick_rate),
        ("stream", "stream", pick_rate),
    ];
    for (what, w, pick) in rows {
        let _ = write!(md, "| {what} |");
        for (locality, dest) in mesh_variants() {
            let path = PathSpec {
                mode: Mode::Iptables,
                locality,
                dest,
            };
            let cell = index
                .ratio(placement, w, path, baseline_of(path, Mode::Direct), pick)
                .map(|s| format!("{:.2}×", s.median))
                .unwrap_or_else(|| "–".into());
            let _ = write!(md, " {cell} |");
        }
        md.push('\n');
    }
    md
}

#[cfg(test)]
#[path = "targets_tests.rs"]
mod tests;
