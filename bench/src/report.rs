//! From measurements to what a reader takes in: medians and spreads per
//! path, ratios (eBPF vs iptables, vs direct) paired within each repetition
//! of the same run, the targets, the cost, and the Markdown report.

use std::{collections::BTreeMap, fmt::Write as _};

use hdrhistogram::Histogram;

use crate::{
    client::{WorkloadKind, new_histogram},
    harness::{Dest, Locality, Mode, PathSpec, Placement, Record, RunResults, Workload},
};

/// What one measurement says, in the units the report uses.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    /// Transactions per second (connections per second for `crr`); for the
    /// stream, Gbit/s.
    pub rate: f64,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub p999: Option<f64>,
    /// CPU of the path (agents, client, server, ksoftirqd) per transaction,
    /// µs (stream: CPU-seconds per GB).
    pub cpu_per_txn: f64,
    /// The agents' CPU per transaction, µs (stream: CPU-seconds per GB).
    pub agent_per_txn: f64,
    /// Cores the path used (CPU-seconds per second).
    pub cores_path: f64,
    pub cores_agent: f64,
    /// The whole machine's busy cores over the run, split (`/proc/stat`).
    pub cores_user: f64,
    pub cores_system: f64,
    pub cores_softirq: f64,
    /// Busy cores of the machine not spent by the path: other work.
    pub cores_background: f64,
    /// Share of CPU time stolen by the hypervisor, %.
    pub steal_pct: f64,
    pub tcp_peak_mib: f64,
    pub tcp_growth_mib: f64,
}

pub fn metrics(record: &Record, kind: WorkloadKind) -> Metrics {
    let r = &record.report;
    let elapsed = r.elapsed.max(1e-9);
    let hz = r.cost.clock_ticks.max(1) as f64;
    let m = &r.cost.machine;
    let path_s = r.cost.path_seconds();
    let agent_s = r.cost.agent_seconds();
    let (rate, per_unit, unit_scale) = match kind {
        // Gbit/s; cost per GB.
        WorkloadKind::Stream => (
            r.txns as f64 * 8.0 / elapsed / 1e9,
            r.txns as f64 / 1e9,
            1.0,
        ),
        _ => (r.txns as f64 / elapsed, r.txns as f64, 1e6),
    };
    let per = |seconds: f64| {
        if per_unit > 0.0 {
            seconds / per_unit * unit_scale
        } else {
            0.0
        }
    };
    let hist = histogram(&r.histogram);
    let pct = |q: f64| {
        hist.as_ref()
            .map(|h| h.value_at_quantile(q) as f64 / 1000.0)
    };
    let page = crate::sys::page_size() as f64;
    let machine_busy = m.busy() as f64 / hz / elapsed;
    Metrics {
        rate,
        p50: pct(0.50),
        p90: pct(0.90),
        p99: pct(0.99),
        p999: pct(0.999),
        cpu_per_txn: per(path_s),
        agent_per_txn: per(agent_s),
        cores_path: path_s / elapsed,
        cores_agent: agent_s / elapsed,
        cores_user: (m.user + m.nice) as f64 / hz / elapsed,
        cores_system: (m.system + m.irq) as f64 / hz / elapsed,
        cores_softirq: m.softirq as f64 / hz / elapsed,
        cores_background: (machine_busy - path_s / elapsed).max(0.0),
        steal_pct: if m.total() > 0 {
            m.steal as f64 * 100.0 / m.total() as f64
        } else {
            0.0
        },
        tcp_peak_mib: r.tcp_mem_peak_pages as f64 * page / (1024.0 * 1024.0),
        tcp_growth_mib: r.tcp_mem_peak_pages.saturating_sub(r.tcp_mem_base_pages) as f64 * page
            / (1024.0 * 1024.0),
    }
}

fn histogram(pairs: &[(u64, u64)]) -> Option<Histogram<u64>> {
    if pairs.is_empty() {
        return None;
    }
    let mut h = new_histogram();
    for &(value, count) in pairs {
        let _ = h.record_n(value.max(1), count);
    }
    Some(h)
}

/// Median, min and max of repeated measurements.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Stat {
    pub fn of(values: &[f64]) -> Option<Stat> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Stat {
            median,
            min: v[0],
            max: v[n - 1],
            n,
        })
    }

    /// Half the range relative to the median, %.
    pub fn spread_pct(&self) -> f64 {
        if self.median.abs() < f64::EPSILON {
            0.0
        } else {
            (self.max - self.min) / 2.0 / self.median.abs() * 100.0
        }
    }
}

/// A metric picked out of [`Metrics`].
pub type Pick = fn(&Metrics) -> Option<f64>;

pub fn pick_rate(m: &Metrics) -> Option<f64> {
    Some(m.rate)
}
pub fn pick_p50(m: &Metrics) -> Option<f64> {
    m.p50
}
pub fn pick_p90(m: &Metrics) -> Option<f64> {
    m.p90
}
pub fn pick_p99(m: &Metrics) -> Option<f64> {
    m.p99
}
pub fn pick_p999(m: &Metrics) -> Option<f64> {
    m.p999
}
pub fn pick_cpu(m: &Metrics) -> Option<f64> {
    Some(m.cpu_per_txn)
}
pub fn pick_agent(m: &Metrics) -> Option<f64> {
    Some(m.agent_per_txn)
}

/// The measurements of a run, indexed.
pub struct Index<'a> {
    pub results: &'a RunResults,
    by_key: BTreeMap<(Placement, String, PathSpec), Vec<&'a Record>>,
}

impl<'a> Index<'a> {
    pub fn new(results: &'a RunResults) -> Index<'a> {
        let mut by_key: BTreeMap<_, Vec<&Record>> = BTreeMap::new();
        for r in &results.records {
            by_key
                .entry((r.placement, r.workload.clone(), r.path))
                .or_default()
                .push(r);
        }
        Index { results, by_key }
    }

    pub fn workload(&self, id: &str) -> Option<&'a Workload> {
        self.results.workloads.iter().find(|w| w.id == id)
    }

    pub fn records(&self, placement: Placement, workload: &str, path: PathSpec) -> &[&'a Record] {
        self.by_key
            .get(&(placement, workload.to_string(), path))
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Median/min/max of a metric over the verified repetitions.
    pub fn stat(
        &self,
        placement: Placement,
        workload: &str,
        path: PathSpec,
        pick: Pick,
    ) -> Option<Stat> {
        let kind = self.workload(workload)?.kind;
        let values: Vec<f64> = self
            .records(placement, workload, path)
            .iter()
            .filter(|r| r.verified)
            .filter_map(|r| pick(&metrics(r, kind)))
            .collect();
        Stat::of(&values)
    }

    /// A latency percentile (µs) over all repetitions pooled.
    pub fn pooled(
        &self,
        placement: Placement,
        workload: &str,
        path: PathSpec,
        quantile: f64,
    ) -> Option<f64> {
        let mut h = new_histogram();
        let mut any = false;
        for r in self.records(placement, workload, path) {
            if let (true, Some(rh)) = (r.verified, histogram(&r.report.histogram)) {
                let _ = h.add(&rh);
                any = true;
            }
        }
        any.then(|| h.value_at_quantile(quantile) as f64 / 1000.0)
    }

    /// `a / b` paired by repetition (both measured within the same pass),
    /// then summarized.
    pub fn ratio(
        &self,
        placement: Placement,
        workload: &str,
        a: PathSpec,
        b: PathSpec,
        pick: Pick,
    ) -> Option<Stat> {
        let kind = self.workload(workload)?.kind;
        let value = |path: PathSpec, rep: usize| -> Option<f64> {
            self.records(placement, workload, path)
                .iter()
                .find(|r| r.rep == rep && r.verified)
                .and_then(|r| pick(&metrics(r, kind)))
        };
        let ratios: Vec<f64> = (0..self.results.reps)
            .filter_map(|rep| {
                let (x, y) = (value(a, rep)?, value(b, rep)?);
                (y > 0.0).then(|| x / y)
            })
            .collect();
        Stat::of(&ratios)
    }
}

pub fn path_label(p: &PathSpec) -> String {
    let locality = match p.locality {
        Locality::Same => "same node",
        Locality::Cross => "cross node",
    };
    match p.mode {
        Mode::Direct => format!("direct · {locality}"),
        mode => {
            let dest = match p.dest {
                Dest::Plain => "passthrough",
                Dest::Hbone => "HBONE",
            };
            let mode = match mode {
                Mode::Iptables => "iptables+proxy",
                Mode::EbpfSplice => "eBPF+proxy+splice",
                _ => "eBPF+proxy",
            };
            format!("{mode} · {locality} · {dest}")
        }
    }
}

/// 12345 → "12.3k".
pub fn human(x: f64) -> String {
    let a = x.abs();
    if a >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", x / 1e3)
    } else if a >= 1e3 {
        format!("{:.2}k", x / 1e3)
    } else if a >= 100.0 {
        format!("{x:.0}")
    } else if a >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

fn with_spread(s: Option<Stat>) -> String {
    match s {
        None => "–".into(),
        Some(s) if s.n > 1 => format!("{} ±{:.0}%", human(s.median), s.spread_pct()),
        Some(s) => human(s.median),
    }
}

fn plain(s: Option<Stat>) -> String {
    s.map(|s| human(s.median)).unwrap_or_else(|| "–".into())
}

fn range(s: Option<Stat>) -> String {
    match s {
        None => "–".into(),
        Some(s) if s.n > 1 => format!("{} ({}–{})", human(s.median), human(s.min), human(s.max)),
        Some(s) => human(s.median),
    }
}

/// One line of progress for a measurement.
pub fn one_line(record: &Record, workload: &Workload) -> String {
    let m = metrics(record, workload.kind);
    let what = match workload.kind {
        WorkloadKind::Stream => format!("{:.2} Gbit/s", m.rate),
        WorkloadKind::Crr => format!("{} conn/s", human(m.rate)),
        _ => format!("{} req/s", human(m.rate)),
    };
    let lat = m
        .p50
        .map(|p| {
            format!(
                " p50 {} µs p99 {} µs",
                human(p),
                human(m.p99.unwrap_or(0.0))
            )
        })
        .unwrap_or_default();
    let status = if record.verified {
        "ok".to_string()
    } else {
        format!("FAILED: {}", record.problems.join("; "))
    };
    format!(
        "{what}{lat} | path {:.2} cores (agents {:.2}), machine usr/sys/sirq {:.2}/{:.2}/{:.2}, other {:.2}, steal {:.0}% | {status}",
        m.cores_path,
        m.cores_agent,
        m.cores_user,
        m.cores_system,
        m.cores_softirq,
        m.cores_background,
        m.steal_pct
    )
}

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

fn baseline_of(path: PathSpec, against: Mode) -> PathSpec {
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
            let met = if t.at_least {
                s.median >= t.bound
            } else {
                s.median <= t.bound
            };
            Some((s, met))
        })
        .collect()
}

fn ratio_cell(cell: &Option<(Stat, bool)>) -> String {
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

/// The headline table for one placement: one row per path.
pub fn headline_table(index: &Index, placement: Placement) -> String {
    let mut md = String::new();
    md.push_str("| path | RR 1 B req/s | RR 1 B p50 µs | RR 1 B p99 µs | RR 1 KiB req/s | conn/s | stream Gbit/s | 1000 req/s p50 / p99 / p99.9 µs | CPU µs per RR (path / agents) |\n");
    md.push_str("|---|--:|--:|--:|--:|--:|--:|--:|--:|\n");
    for &path in &index.results.paths {
        let s = |w: &str, pick: Pick| index.stat(placement, w, path, pick);
        let fixed = format!(
            "{} / {} / {}",
            plain(s("rate", pick_p50)),
            plain(s("rate", pick_p99)),
            index
                .pooled(placement, "rate", path, 0.999)
                .map(human)
                .unwrap_or_else(|| "–".into())
        );
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
            path_label(&path),
            with_spread(s("rr1", pick_rate)),
            plain(s("rr1", pick_p50)),
            plain(s("rr1", pick_p99)),
            with_spread(s("rr1k", pick_rate)),
            with_spread(s("crr", pick_rate)),
            with_spread(s("stream", pick_rate)),
            fixed,
            plain(s("rr1", pick_cpu)),
            plain(s("rr1", pick_agent)),
        );
    }
    md
}

/// The targets for eBPF with splice off and, where measured, on.
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

/// Where the CPU goes, per path: machine cores split, the agents' share,
/// CPU per transaction, memory.
pub fn cost_table(index: &Index, placement: Placement) -> String {
    let mut md = String::new();
    md.push_str("| path | CPU µs per RR 1 B (agents) | CPU µs per connection (agents) | CPU s per GB streamed (agents) | during RR 1 B: path cores · machine usr / sys / softirq · other work | steal % | agent RSS MiB (peak) | kernel TCP mem peak MiB (stream) |\n");
    md.push_str("|---|--:|--:|--:|--:|--:|--:|--:|\n");
    for &path in &index.results.paths {
        let recs = |w: &str| index.records(placement, w, path);
        let kind = |w: &str| {
            index
                .workload(w)
                .map(|w| w.kind)
                .unwrap_or(WorkloadKind::Rr)
        };
        let med = |w: &str, f: fn(&Metrics) -> f64| -> Option<f64> {
            let k = kind(w);
            let v: Vec<f64> = recs(w)
                .iter()
                .filter(|r| r.verified)
                .map(|r| f(&metrics(r, k)))
                .collect();
            Stat::of(&v).map(|s| s.median)
        };
        let fmt = |x: Option<f64>, digits: usize| {
            x.map(|x| format!("{x:.digits$}"))
                .unwrap_or_else(|| "–".into())
        };
        let cores = format!(
            "{} · {} / {} / {} · {}",
            fmt(med("rr1", |m| m.cores_path), 2),
            fmt(med("rr1", |m| m.cores_user), 2),
            fmt(med("rr1", |m| m.cores_system), 2),
            fmt(med("rr1", |m| m.cores_softirq), 2),
            fmt(med("rr1", |m| m.cores_background), 2),
        );
        let per = |w: &str, digits: usize| {
            format!(
                "{} ({})",
                fmt(med(w, |m| m.cpu_per_txn), digits),
                fmt(med(w, |m| m.agent_per_txn), digits)
            )
        };
        let steal: Vec<f64> = index
            .results
            .workloads
            .iter()
            .flat_map(|w| recs(&w.id).iter().map(|r| metrics(r, w.kind).steal_pct))
            .collect();
        let all: Vec<&Record> = index
            .results
            .workloads
            .iter()
            .flat_map(|w| recs(&w.id).iter().copied())
            .collect();
        let rss = all
            .iter()
            .flat_map(|r| r.agent_rss_kib.iter().copied())
            .max();
        let hwm = all
            .iter()
            .flat_map(|r| r.agent_hwm_kib.iter().copied())
            .max();
        let memory = match (rss, hwm) {
            (Some(rss), Some(hwm)) => {
                format!("{:.1} ({:.1})", rss as f64 / 1024.0, hwm as f64 / 1024.0)
            }
            _ => "no agent".into(),
        };
        let tcp = recs("stream")
            .iter()
            .map(|r| metrics(r, WorkloadKind::Stream).tcp_peak_mib)
            .fold(None, |acc: Option<f64>, x| {
                Some(acc.map_or(x, |a| a.max(x)))
            });
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {cores} | {} | {memory} | {} |",
            path_label(&path),
            per("rr1", 1),
            per("crr", 1),
            per("stream", 2),
            fmt(Stat::of(&steal).map(|s| s.median), 1),
            fmt(tcp, 1),
        );
    }
    md
}

/// Every workload's full numbers for one placement.
pub fn detail_tables(index: &Index, placement: Placement) -> String {
    let mut md = String::new();
    for w in &index.results.workloads {
        let unit = match w.kind {
            WorkloadKind::Stream => "Gbit/s",
            WorkloadKind::Crr => "conn/s",
            _ => "req/s",
        };
        let _ = writeln!(
            md,
            "\n**{}** ({}, {} s per run)\n",
            w.title, w.id, w.seconds
        );
        if w.kind == WorkloadKind::Stream {
            let _ = writeln!(
                md,
                "| path | {unit} median (min–max) | CPU s/GB (agents) | path cores · machine usr / sys / softirq · other | verified |"
            );
            md.push_str("|---|--:|--:|--:|--:|\n");
        } else {
            let _ = writeln!(
                md,
                "| path | {unit} median (min–max) | p50 µs | p90 µs | p99 µs | p99.9 µs (pooled) | CPU µs/txn (agents) | path cores · machine usr / sys / softirq · other | verified |"
            );
            md.push_str("|---|--:|--:|--:|--:|--:|--:|--:|--:|\n");
        }
        for &path in &index.results.paths {
            let recs = index.records(placement, &w.id, path);
            let ok = recs.iter().filter(|r| r.verified).count();
            let s = |pick: Pick| index.stat(placement, &w.id, path, pick);
            let med = |f: fn(&Metrics) -> f64| -> String {
                let v: Vec<f64> = recs
                    .iter()
                    .filter(|r| r.verified)
                    .map(|r| f(&metrics(r, w.kind)))
                    .collect();
                Stat::of(&v)
                    .map(|s| format!("{:.2}", s.median))
                    .unwrap_or_else(|| "–".into())
            };
            let cores = format!(
                "{} · {} / {} / {} · {}",
                med(|m| m.cores_path),
                med(|m| m.cores_user),
                med(|m| m.cores_system),
                med(|m| m.cores_softirq),
                med(|m| m.cores_background)
            );
            let cpu = format!("{} ({})", plain(s(pick_cpu)), plain(s(pick_agent)));
            if w.kind == WorkloadKind::Stream {
                let _ = writeln!(
                    md,
                    "| {} | {} | {cpu} | {cores} | {ok}/{} |",
                    path_label(&path),
                    range(s(pick_rate)),
                    recs.len()
                );
            } else {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {cpu} | {cores} | {ok}/{} |",
                    path_label(&path),
                    range(s(pick_rate)),
                    plain(s(pick_p50)),
                    plain(s(pick_p90)),
                    plain(s(pick_p99)),
                    index
                        .pooled(placement, &w.id, path, 0.999)
                        .map(human)
                        .unwrap_or_else(|| "–".into()),
                    recs.len()
                );
            }
        }
    }
    md
}

/// The whole Markdown report.
pub fn markdown(results: &RunResults, svg_name: &str) -> String {
    let index = Index::new(results);
    let m = &results.machine;
    let mut md = String::new();
    let when = format_unix(results.started_unix);
    let _ = writeln!(
        md,
        "# shunt benchmark{}\n",
        if results.quick {
            " (quick: 1 short repetition, a smoke test, not a measurement)"
        } else {
            ""
        }
    );
    let failures: Vec<&Record> = results.records.iter().filter(|r| !r.verified).collect();
    let _ = writeln!(
        md,
        "{when} · commit `{}` · {} · kernel {} · {} × {} ({}), {} MiB · {} · {} repetition(s), paths interleaved · run took {:.0} s · {} of {} measurements verified\n",
        m.commit,
        m.rustc,
        m.kernel,
        m.cpus,
        m.cpu_model,
        m.virtualization,
        m.memory_mib,
        results.shunt_binary,
        results.reps,
        results.duration_s,
        results.records.len() - failures.len(),
        results.records.len(),
    );
    let total = results.machine_cpu.total().max(1) as f64;
    let _ = writeln!(
        md,
        "Machine during the run: load average {} at start, {} at end; steal {:.1}% of all CPU time over the run. The machine was shared with other work, which these numbers include.\n",
        results.load_average_start,
        results.load_average_end,
        results.machine_cpu.steal as f64 * 100.0 / total,
    );
    for note in &results.notes {
        let _ = writeln!(md, "Note: {note}\n");
    }
    md.push_str("Paths: **direct** = no mesh, no agent (the physical limit); **iptables+proxy** and **eBPF+proxy** = the agent's redirection mode with its built-in proxy; **eBPF+proxy+splice** = the same with `--splice on` (sk_msg moves app ⇄ proxy bytes past the loopback TCP stack; a direction whose reader falls over 1 MiB behind goes back to TCP for good, so bulk streams mostly run unspliced). **passthrough** = destination pod outside the mesh (the client-side proxy forwards plain TCP); **HBONE** = destination in the mesh (mTLS HTTP/2 CONNECT between the two proxies; same node still goes through both proxy roles).\n\n");
    let _ = writeln!(md, "![latency and throughput per path]({svg_name})\n");
    for &placement in &results.placements {
        let title = match placement {
            Placement::Pinned => format!(
                "All on one CPU (client, server and agents pinned to CPU {}): the clean per-path cost",
                results.pin_cpu
            ),
            Placement::Scheduler => {
                "The scheduler's choice (every process free on every CPU)".to_string()
            }
        };
        let _ = writeln!(md, "## {title}\n");
        md.push_str(&headline_table(&index, placement));
        md.push_str("\nMedians over repetitions; ±x% = half the min–max range. Latencies are per transaction. The fixed-rate p99.9 pools every repetition's histogram. CPU per RR is the path's CPU (its processes, kernel work in their context — eBPF programs, TCP stack, softirq — included, plus ksoftirqd) over the run divided by transactions; see Cost.\n\n");
        let _ = writeln!(md, "### Targets ({})\n", placement.name());
        md.push_str(&targets_table(&index, placement));
        md.push_str("\nRatios are paired within each repetition (both paths measured in the same pass) and summarized as median (min–max).\n\n");
        md.push_str(&iptables_vs_direct_table(&index, placement));
        let _ = writeln!(md, "\n### Cost ({})\n", placement.name());
        md.push_str(&cost_table(&index, placement));
        md.push_str("\nPath CPU = the cgroup `cpu.stat` usage of the path's processes (both agents of its topology, the load generator, the servers; softirq work done in their context included, as this kernel has no IRQ time accounting) plus the `ksoftirqd` threads. Cores = CPU-seconds per second of the run, of the machine's ");
        let _ = write!(md, "{}", m.cpus);
        md.push_str("; machine usr / sys / softirq is `/proc/stat` for the whole machine (usr includes nice, sys includes irq), and other work = machine busy − path, i.e. what else ran on the shared machine meanwhile.\n\n");
        let _ = writeln!(
            md,
            "<details><summary>Every workload, {} placement</summary>\n",
            placement.name()
        );
        md.push_str(&detail_tables(&index, placement));
        md.push_str("\n</details>\n\n");
    }
    md.push_str(&stalls(results));
    if !failures.is_empty() {
        md.push_str("## Failed measurements\n\n");
        for r in failures.iter().take(50) {
            let _ = writeln!(
                md,
                "- {} {} {} rep {}: {}",
                r.placement.name(),
                r.workload,
                r.path_id,
                r.rep + 1,
                r.problems.join("; ")
            );
        }
        md.push('\n');
    }
    md.push_str(&method(results));
    md
}

/// The Benchmarks section of the README: the pinned headline table and the
/// targets in both placements, pointing at the full report.
pub fn readme_section(results: &RunResults, report_path: &str) -> String {
    let index = Index::new(results);
    let m = &results.machine;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "Latest full run ({}, commit `{}`, kernel {}, {} × {} ({}), {} repetitions, paths interleaved, load average {} at start; [full report]({report_path}) with the scheduler placement, cost, every percentile and the method):\n",
        format_unix(results.started_unix),
        m.commit,
        m.kernel,
        m.cpus,
        m.cpu_model,
        m.virtualization,
        results.reps,
        results.load_average_start,
    );
    if results.placements.contains(&Placement::Pinned) {
        let _ = writeln!(
            md,
            "All processes of a path pinned to one CPU (the clean per-path cost), medians:\n"
        );
        md.push_str(&headline_table(&index, Placement::Pinned));
    }
    for &placement in &results.placements {
        let _ = writeln!(
            md,
            "\nTargets, {} placement (eBPF+proxy with splice off, and on; ratios paired per repetition, median (min–max)):\n",
            placement.name()
        );
        md.push_str(&targets_table(&index, placement));
    }
    md
}

/// Measurements in which some transaction took over 100 ms: on an idle
/// machine none does, so these show interference (the host, other work)
/// rather than the path; they stay in the medians, which they barely move,
/// but they widen the spreads.
fn stalls(results: &RunResults) -> String {
    let mut lines = Vec::new();
    for r in &results.records {
        let slow: Vec<(u64, u64)> = r
            .report
            .histogram
            .iter()
            .copied()
            .filter(|(v, _)| *v > 100_000_000)
            .collect();
        if slow.is_empty() {
            continue;
        }
        let count: u64 = slow.iter().map(|(_, c)| c).sum();
        let max = slow.iter().map(|(v, _)| *v).max().unwrap_or(0);
        lines.push(format!(
            "- {} {} {} rep {}: {count} transaction(s) over 100 ms, the longest {:.0} ms",
            r.placement.name(),
            r.workload,
            r.path_id,
            r.rep + 1,
            max as f64 / 1e6
        ));
    }
    if lines.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "## Stalls\n\nMeasurements in which some transaction took over 100 ms. Nothing on these paths should (an idle machine shows none); when they hit direct paths too, at the same moment, they are the shared machine's, not the path's. They are kept in the medians (which they barely move) and show in the spreads.\n\n",
    );
    let shown = lines.len().min(30);
    md.push_str(&lines[..shown].join("\n"));
    if lines.len() > shown {
        let _ = write!(md, "\n- … and {} more", lines.len() - shown);
    }
    md.push_str("\n\n");
    md
}

fn method(results: &RunResults) -> String {
    let mut md = String::from("## Method\n\n");
    md.push_str("- Three topologies side by side in network namespaces (198.18.0.0/15 only), each two nodes joined by a fabric bridge: one without any agent (direct), one with an agent per node in `--redirect iptables`, one in `--redirect ebpf`, all the real `shunt agent` binary at its default log level (info, access log included). Client pod on node-a; server pods in and out of the mesh on node-a (same node) and node-b (cross node).\n");
    md.push_str("- Load generator and servers: this crate's own (`shunt-bench client|server`, tokio current-thread runtime, HdrHistogram), one process each, started inside the pod's netns **and** inside the apps cgroup below the agent's cgroup root, like a pod's containers, so the eBPF connect hooks see them.\n");
    md.push_str("- Workloads: ");
    let names: Vec<String> = results
        .workloads
        .iter()
        .map(|w| {
            format!(
                "`{}` {} ({} s, {} s warm-up)",
                w.id, w.title, w.seconds, w.warmup
            )
        })
        .collect();
    md.push_str(&names.join("; "));
    md.push_str(". Request/response and connection workloads keep one transaction in flight; a new-connection transaction is connect, 1 B request, response, half-close, server close. The fixed-rate workload is open loop and corrects for coordinated omission (HdrHistogram `record_correct`).\n");
    md.push_str("- Verification on every measurement: every response is compared byte for byte with its request; the stream sink checks every byte against a period-251 pattern and returns its count, which must equal what was sent; the agents' proxy counters must account for every connection (passthrough connections, or HBONE streams on both proxies) and every byte, with nothing refused or failed, so no path can silently bypass its proxy. Peak kernel TCP memory (`/proc/net/sockstat`, machine-wide) is sampled every 25 ms.\n");
    md.push_str("- Cost, read by the load generator over exactly its load window: the path's CPU from cgroup v2 `cpu.stat` (the apps cgroup: load generator and servers; a cgroup the agents are moved into, beside — never below — the cgroup root their programs attach to) plus the `ksoftirqd` threads; the whole machine's and the placed CPUs' `/proc/stat` (user/system/softirq/steal); the agents' VmRSS/VmHWM after each run. When a measurement fails its checks, the agents' logs are kept next to the raw JSON.\n");
    md.push_str("- Order: for each repetition, placement and workload, every path once, in an order rotated between workloads and repetitions. Pinned placement: `sched_setaffinity` on every thread of the client, the server and both agents (softirq work of veth follows the sending CPU); the harness itself moves to the other CPU.\n");
    md.push_str("- Pod sysctls on every path: `tcp_tw_reuse=1`, `ip_local_port_range=10000 65000` (connection churn must not run out of ports).\n");
    md
}

fn format_unix(secs: u64) -> String {
    // Civil date from days since the epoch (UTC).
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_and_dates() {
        let s = Stat::of(&[3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!(s.median, 2.5);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 10.0);
        assert_eq!(format_unix(0), "1970-01-01 00:00 UTC");
        assert_eq!(format_unix(1_700_000_000), "2023-11-14 22:13 UTC");
        assert_eq!(human(12345.0), "12.3k");
    }
}
