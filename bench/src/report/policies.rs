//! `--policies`: connections/s and request/response rate with 0, 10, 1,000…
//! AuthorizationPolicies on the destination, and the ratio of the most to
//! the fewest, paired within each repetition (the counts of one repetition
//! are measured back to back, so a busy moment of the shared machine hits
//! them alike).

use std::fmt::Write as _;

use super::{
    stats::{Stat, metrics},
    tables::{human, path_label},
};
use crate::model::{Placement, Record, RunResults};

/// The workloads the table shows, and what their rate is.
const SHOWN: [(&str, &str); 2] = [
    ("crr", "connections/s"),
    ("rr1", "request/response 1 B, req/s"),
];

fn records<'a>(
    results: &'a RunResults,
    placement: Placement,
    workload: &'a str,
    path: &'a crate::model::PathSpec,
    count: usize,
) -> impl Iterator<Item = &'a Record> + 'a {
    results.records.iter().filter(move |r| {
        r.verified
            && r.placement == placement
            && r.workload == workload
            && r.path == *path
            && r.policies == Some(count)
    })
}

fn rate(results: &RunResults, record: &Record) -> Option<f64> {
    let kind = results
        .workloads
        .iter()
        .find(|w| w.id == record.workload)?
        .kind;
    Some(metrics(record, kind).rate)
}

/// The table for `placement`; empty when the run did not vary policies.
pub fn policies_table(results: &RunResults, placement: Placement) -> String {
    let counts = &results.policies;
    let (Some(&fewest), Some(&most)) = (counts.iter().min(), counts.iter().max()) else {
        return String::new();
    };
    let mut md = String::from("| path | metric |");
    for n in counts {
        let _ = write!(md, " {n} policies |");
    }
    let _ = writeln!(md, " {most} vs {fewest} |");
    md.push_str("|---|---|");
    for _ in counts {
        md.push_str("--:|");
    }
    md.push_str("--:|\n");
    for path in &results.paths {
        for (workload, what) in SHOWN {
            if !results.workloads.iter().any(|w| w.id == workload) {
                continue;
            }
            let _ = write!(md, "| {} | {what} |", path_label(path));
            for &n in counts {
                let values: Vec<f64> = records(results, placement, workload, path, n)
                    .filter_map(|r| rate(results, r))
                    .collect();
                let cell = match Stat::of(&values) {
                    None => "–".to_string(),
                    Some(s) if s.n > 1 => format!("{} ±{:.0}%", human(s.median), s.spread_pct()),
                    Some(s) => human(s.median),
                };
                let _ = write!(md, " {cell} |");
            }
            let at = |n: usize, rep: usize| {
                records(results, placement, workload, path, n)
                    .find(|r| r.rep == rep)
                    .and_then(|r| rate(results, r))
            };
            let ratios: Vec<f64> = (0..results.reps)
                .filter_map(|rep| {
                    let (x, y) = (at(most, rep)?, at(fewest, rep)?);
                    (y > 0.0).then(|| x / y)
                })
                .collect();
            let ratio = match Stat::of(&ratios) {
                None => "–".to_string(),
                Some(s) if s.n > 1 => format!("{:.2}× ({:.2}–{:.2})", s.median, s.min, s.max),
                Some(s) => format!("{:.2}×", s.median),
            };
            let _ = writeln!(md, " {ratio} |");
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        client::ClientReport,
        model::{Dest, Locality, Mode, PathSpec, workloads},
        sys::{CpuTimes, Machine},
    };

    fn record(path: PathSpec, workload: &str, rep: usize, policies: usize, rate: u64) -> Record {
        Record {
            path,
            path_id: path.id(),
            workload: workload.into(),
            placement: Placement::Pinned,
            rep,
            report: ClientReport {
                ok: true,
                txns: rate,
                elapsed: 1.0,
                ..Default::default()
            },
            proxy: None,
            agent_rss_kib: Vec::new(),
            agent_hwm_kib: Vec::new(),
            load_average: String::new(),
            verified: true,
            problems: Vec::new(),
            policies: Some(policies),
        }
    }

    #[test]
    fn counts_are_columns_and_the_ratio_is_paired_per_repetition() {
        let path = PathSpec {
            mode: Mode::Ebpf,
            locality: Locality::Cross,
            dest: Dest::Hbone,
        };
        let mut records = Vec::new();
        for (rep, (none, many)) in [(1000, 900), (2000, 1000)].into_iter().enumerate() {
            records.push(record(path, "crr", rep, 0, none));
            records.push(record(path, "crr", rep, 1000, many));
        }
        let results = RunResults {
            name: "t".into(),
            quick: false,
            started_unix: 0,
            duration_s: 1.0,
            machine: Machine::default(),
            shunt_binary: String::new(),
            reps: 2,
            pin_cpu: 1,
            placements: vec![Placement::Pinned],
            workloads: workloads(false),
            paths: vec![path],
            load_average_start: String::new(),
            load_average_end: String::new(),
            machine_cpu: CpuTimes::default(),
            records,
            notes: Vec::new(),
            policies: vec![0, 1000],
        };
        let table = policies_table(&results, Placement::Pinned);
        let crr = table
            .lines()
            .find(|l| l.contains("connections/s"))
            .expect("a crr row");
        // Medians 1.50k and 950; ratios 0.90 and 0.50, paired per rep (not
        // 950 / 1500 = 0.63).
        assert!(
            crr.contains("| 1.50k ±33% | 950 ±5% | 0.70× (0.50–0.90) |"),
            "{crr}"
        );
        assert!(
            table
                .lines()
                .any(|l| l.contains("req/s") && l.contains("| – | – | – |")),
            "{table}"
        );
    }
}
