//! The verdict on made-up runs whose every figure is known: ratios paired
//! per repetition, median/min/max, met and missed (the bound itself meets
//! it), the ✅/❌ cells and the targets table, and a report that comes out
//! the same from its own JSON.

use super::*;
use crate::{
    client::ClientReport,
    model::{Record, RunResults, Workload, workloads},
    sys::{CpuTimes, Machine},
};

const PLACEMENT: Placement = Placement::Pinned;

fn path(mode: Mode) -> PathSpec {
    PathSpec {
        mode,
        locality: Locality::Same,
        dest: Dest::Plain,
    }
}

/// A measurement of `workload` on `path` in repetition `rep` whose rate is
/// `rate` per second and whose latencies are all `latency_us`.
fn record(path: PathSpec, workload: &str, rep: usize, rate: u64, latency_us: u64) -> Record {
    Record {
        path,
        path_id: path.id(),
        workload: workload.to_string(),
        placement: PLACEMENT,
        rep,
        report: ClientReport {
            ok: true,
            txns: rate,
            connections: 1,
            bytes_sent: rate,
            bytes_received: rate,
            intact: true,
            elapsed: 1.0,
            histogram: vec![(latency_us * 1000, rate)],
            ..Default::default()
        },
        proxy: None,
        agent_rss_kib: Vec::new(),
        agent_hwm_kib: Vec::new(),
        load_average: "0.00 0.00 0.00".into(),
        verified: true,
        problems: Vec::new(),
        policies: None,
    }
}

fn run(paths: Vec<PathSpec>, reps: usize, records: Vec<Record>) -> RunResults {
    let workloads: Vec<Workload> = workloads(false);
    RunResults {
        name: "test".into(),
        quick: false,
        started_unix: 1_700_000_000,
        duration_s: 60.0,
        machine: Machine::default(),
        shunt_binary: "shunt".into(),
        reps,
        pin_cpu: 1,
        placements: vec![PLACEMENT],
        workloads,
        paths,
        load_average_start: "0.00 0.00 0.00".into(),
        load_average_end: "0.00 0.00 0.00".into(),
        machine_cpu: CpuTimes::default(),
        records,
        notes: Vec::new(),
        policies: Vec::new(),
    }
}

/// eBPF and iptables on one variant, `crr` rates per repetition.
fn crr_run(ebpf: &[u64], iptables: &[u64]) -> RunResults {
    let mut records = Vec::new();
    for (rep, (&e, &i)) in ebpf.iter().zip(iptables).enumerate() {
        records.push(record(path(Mode::Ebpf), "crr", rep, e, 100));
        records.push(record(path(Mode::Iptables), "crr", rep, i, 100));
    }
    run(
        vec![path(Mode::Iptables), path(Mode::Ebpf)],
        ebpf.len(),
        records,
    )
}

fn connections_target() -> Target {
    targets()
        .into_iter()
        .find(|t| t.workload == "crr" && t.against == Mode::Iptables)
        .expect("the connections/s target")
}

#[test]
fn ratios_are_paired_within_each_repetition() {
    // Per repetition 100/50, 60/60, 30/10: ratios 2, 1, 3. The medians'
    // ratio (60/50 = 1.2) is not what the report shows.
    let results = crr_run(&[100, 60, 30], &[50, 60, 10]);
    let index = Index::new(&results);
    let s = index
        .ratio(
            PLACEMENT,
            "crr",
            path(Mode::Ebpf),
            path(Mode::Iptables),
            pick_rate,
        )
        .expect("a ratio");
    assert_eq!((s.median, s.min, s.max, s.n), (2.0, 1.0, 3.0, 3));
}

#[test]
fn a_repetition_with_an_unverified_side_is_left_out() {
    let mut results = crr_run(&[100, 60, 30], &[50, 60, 10]);
    for r in &mut results.records {
        if r.rep == 1 && r.path.mode == Mode::Iptables {
            r.verified = false;
        }
    }
    let index = Index::new(&results);
    let s = index
        .ratio(
            PLACEMENT,
            "crr",
            path(Mode::Ebpf),
            path(Mode::Iptables),
            pick_rate,
        )
        .expect("a ratio");
    assert_eq!((s.median, s.min, s.max, s.n), (2.5, 2.0, 3.0, 2));
}

#[test]
fn median_min_max_of_repetitions() {
    let s = Stat::of(&[3.0, 1.0, 2.0, 10.0]).expect("stat");
    assert_eq!((s.median, s.min, s.max, s.n), (2.5, 1.0, 10.0, 4));
    let s = Stat::of(&[5.0, f64::NAN, 1.0, f64::INFINITY, 3.0]).expect("stat");
    assert_eq!((s.median, s.min, s.max, s.n), (3.0, 1.0, 5.0, 3));
    assert!(Stat::of(&[]).is_none());
    assert!(Stat::of(&[f64::NAN]).is_none());
}

#[test]
fn a_target_is_met_at_its_bound_and_missed_beyond_it() {
    let at_least = connections_target();
    assert!(at_least.met(1.5) && at_least.met(1.6));
    assert!(!at_least.met(1.499));
    let at_most = targets()
        .into_iter()
        .find(|t| !t.at_least)
        .expect("a latency target");
    assert_eq!(at_most.bound, 0.75);
    assert!(at_most.met(0.75) && at_most.met(0.5));
    assert!(!at_most.met(0.76));
}

#[test]
fn cells_judge_the_median_of_the_paired_ratios() {
    let t = connections_target();
    // Ratios 1.6, 1.2, 1.7: median 1.6 meets ≥ 1.5 though one repetition
    // does not.
    let results = crr_run(&[160, 120, 170], &[100, 100, 100]);
    let cells = target_cells(&Index::new(&results), PLACEMENT, Mode::Ebpf, &t);
    assert_eq!(cells.len(), 4, "one cell per variant");
    let (s, met) = cells[0].expect("same node, passthrough measured");
    assert_eq!((s.median, s.min, s.max), (1.6, 1.2, 1.7));
    assert!(met);
    assert!(cells[1..].iter().all(Option::is_none), "not measured");

    // Ratios 1.4, 1.6, 1.3: median 1.4 misses though one repetition meets.
    let results = crr_run(&[140, 160, 130], &[100, 100, 100]);
    let cells = target_cells(&Index::new(&results), PLACEMENT, Mode::Ebpf, &t);
    let (s, met) = cells[0].expect("measured");
    assert_eq!(s.median, 1.4);
    assert!(!met);
}

#[test]
fn a_latency_target_compares_p99s() {
    let t = targets()
        .into_iter()
        .find(|t| t.what.contains("p99"))
        .expect("the p99 target");
    let rr = |ebpf_us: u64, iptables_us: u64| {
        let records = vec![
            record(path(Mode::Ebpf), "rr1", 0, 1000, ebpf_us),
            record(path(Mode::Iptables), "rr1", 0, 1000, iptables_us),
        ];
        run(vec![path(Mode::Iptables), path(Mode::Ebpf)], 1, records)
    };
    let results = rr(600, 1000);
    let (s, met) =
        target_cells(&Index::new(&results), PLACEMENT, Mode::Ebpf, &t)[0].expect("measured");
    assert!((s.median - 0.6).abs() < 0.01, "{s:?}");
    assert!(met, "p99 0.6× meets ≤ 0.75×");
    let results = rr(900, 1000);
    let (s, met) =
        target_cells(&Index::new(&results), PLACEMENT, Mode::Ebpf, &t)[0].expect("measured");
    assert!((s.median - 0.9).abs() < 0.01, "{s:?}");
    assert!(!met, "p99 0.9× misses ≤ 0.75×");
}

#[test]
fn cells_render_mark_median_and_range() {
    let stat = |median, min, max, n| Stat {
        median,
        min,
        max,
        n,
    };
    assert_eq!(
        ratio_cell(&Some((stat(2.0, 1.0, 3.0, 3), true))),
        "✅ 2.00× (1.00–3.00)"
    );
    assert_eq!(
        ratio_cell(&Some((stat(1.16, 1.1, 1.2, 5), false))),
        "❌ 1.16× (1.10–1.20)"
    );
    assert_eq!(
        ratio_cell(&Some((stat(1.4, 1.4, 1.4, 1), false))),
        "❌ 1.40×"
    );
    assert_eq!(ratio_cell(&None), "–");
}

#[test]
fn the_targets_table_shows_each_verdict() {
    let results = crr_run(&[160, 120, 170], &[100, 100, 100]);
    let table = targets_table(&Index::new(&results), PLACEMENT);
    assert!(
        table.contains(
            "| iptables+proxy | connections/s | ≥ 1.50× | ✅ 1.60× (1.20–1.70) | – | – | – |"
        ),
        "{table}"
    );
    // Nothing measured for the other targets: no verdict.
    assert!(
        table.contains("| iptables+proxy | stream throughput | ≥ 1.50× | – | – | – | – |"),
        "{table}"
    );
    let results = crr_run(&[140, 160, 130], &[100, 100, 100]);
    let table = targets_table(&Index::new(&results), PLACEMENT);
    assert!(
        table.contains("| connections/s | ≥ 1.50× | ❌ 1.40× (1.30–1.60) |"),
        "{table}"
    );
}

#[test]
fn the_report_comes_out_the_same_from_its_json() {
    let results = crr_run(&[160, 120, 170], &[100, 100, 100]);
    let json = serde_json::to_string(&results).expect("to JSON");
    assert!(!json.contains('\n'), "compact: one line");
    let back: RunResults = serde_json::from_str(&json).expect("from JSON");
    let md = crate::report::markdown(&results, "test.svg");
    assert_eq!(crate::report::markdown(&back, "test.svg"), md);
    assert!(md.contains("✅ 1.60× (1.20–1.70)"), "{md}");
}
