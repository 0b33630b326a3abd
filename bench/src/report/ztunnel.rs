//! shunt against a stock ztunnel (`--ztunnel`): every shunt proxy path
//! over the ztunnel path between the same pods, paired per repetition, and
//! issue 35's targets on the cross-node HBONE path.

use std::fmt::Write as _;

use super::{
    stats::{Index, Pick, Stat, pick_agent, pick_agent_switches, pick_p99, pick_rate},
    tables::path_label,
    targets::ratio_cell,
};
use crate::model::{Dest, Locality, Mode, PathSpec, Placement};

/// One column: a workload's metric, and the target on cross-node HBONE
/// (bound, at least).
struct Column {
    title: &'static str,
    workload: &'static str,
    pick: Pick,
    target: Option<(f64, bool)>,
}

fn columns() -> [Column; 8] {
    [
        Column {
            title: "request/response 1 B",
            workload: "rr1",
            pick: pick_rate,
            target: Some((1.15, true)),
        },
        Column {
            title: "connections/s",
            workload: "crr",
            pick: pick_rate,
            target: Some((1.15, true)),
        },
        Column {
            title: "stream",
            workload: "stream",
            pick: pick_rate,
            target: Some((1.10, true)),
        },
        Column {
            title: "RR p99",
            workload: "rr1",
            pick: pick_p99,
            target: Some((0.90, false)),
        },
        Column {
            title: "agents' CPU per transaction",
            workload: "rr1",
            pick: pick_agent,
            target: Some((0.85, false)),
        },
        Column {
            title: "agents' CPU per connection",
            workload: "crr",
            pick: pick_agent,
            target: Some((0.85, false)),
        },
        Column {
            title: "agents' context switches per transaction",
            workload: "rr1",
            pick: pick_agent_switches,
            target: None,
        },
        Column {
            title: "agents' context switches per connection",
            workload: "crr",
            pick: pick_agent_switches,
            target: None,
        },
    ]
}

/// The table, or nothing when the run has no ztunnel path.
pub fn ztunnel_table(index: &Index, placement: Placement) -> String {
    let paths = &index.results.paths;
    if !paths.iter().any(|p| p.mode == Mode::Ztunnel) {
        return String::new();
    }
    let cols = columns();
    let mut md = String::from("| shunt path / ztunnel on the same pods |");
    for c in &cols {
        let _ = write!(md, " {} |", c.title);
    }
    md.push_str("\n|---|");
    md.push_str(&"--:|".repeat(cols.len()));
    md.push('\n');
    let mut rows = 0;
    for &path in paths.iter().filter(|p| p.mode != Mode::Ztunnel) {
        let reference = PathSpec {
            mode: Mode::Ztunnel,
            ..path
        };
        if path.mode == Mode::Direct || !paths.contains(&reference) {
            continue;
        }
        let judged =
            path.mode == Mode::Ebpf && path.locality == Locality::Cross && path.dest == Dest::Hbone;
        let _ = write!(md, "| {} |", path_label(&path));
        for c in &cols {
            let ratio = index.ratio(placement, c.workload, path, reference, c.pick);
            let cell = if let (true, Some((bound, at_least))) = (judged, c.target) {
                ratio_cell(&ratio.map(|s: Stat| {
                    let met = if at_least {
                        s.median >= bound
                    } else {
                        s.median <= bound
                    };
                    (s, met)
                }))
            } else {
                plain_ratio(ratio)
            };
            let _ = write!(md, " {cell} |");
        }
        md.push('\n');
        rows += 1;
    }
    if rows == 0 {
        return String::new();
    }
    md.push_str("\nshunt/ztunnel, paired within each repetition, median (min–max); rates above 1 and p99 and CPU below 1 favour shunt. Marks: issue 35's targets on eBPF+proxy · cross node · HBONE (≥ 1.15× request/response and connections/s, ≥ 1.10× stream, ≤ 0.90× p99, ≤ 0.85× the agents' CPU). ztunnel: one per mesh pod, dedicated mode, iptables capture in the pod, `FAKE_CA`, a static local config.\n\n");
    md
}

fn plain_ratio(s: Option<Stat>) -> String {
    match s {
        None => "–".into(),
        Some(s) if s.n > 1 => format!("{:.2}× ({:.2}–{:.2})", s.median, s.min, s.max),
        Some(s) => format!("{:.2}×", s.median),
    }
}
