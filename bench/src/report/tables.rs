//! The report's tables of figures (headline, cost, every workload) and the
//! formatting they share.

use std::fmt::Write as _;

use super::stats::{
    Index, Metrics, Pick, Stat, metrics, pick_agent, pick_cpu, pick_p50, pick_p90, pick_p99,
    pick_rate,
};
use crate::{
    client::WorkloadKind,
    model::{Dest, Locality, Mode, PathSpec, Placement, Record, Workload},
};

pub fn path_label(p: &PathSpec) -> String {
    let locality = match p.locality {
        Locality::Same => "same node",
        Locality::Cross => "cross node",
    };
    match p.mode {
        Mode::Direct => format!("direct · {locality}"),
        mode => {
            let dest = match (p.dest, mode) {
                (Dest::Plain, _) => "passthrough",
                // Flow 2: mesh to mesh, carried in the kernel without HBONE.
                (Dest::Hbone, Mode::EbpfFastPath) => "mesh in the kernel",
                (Dest::Hbone, _) => "HBONE",
            };
            let mode = match mode {
                Mode::Iptables => "iptables+proxy",
                Mode::EbpfSplice => "eBPF+proxy+splice",
                Mode::EbpfFastPath => "eBPF+fast path",
                Mode::Ztunnel => "ztunnel",
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
        "{what}{lat} | agents {:.1} µs, {:.2} switches per txn | path {:.2} cores (agents {:.2}), machine usr/sys/sirq {:.2}/{:.2}/{:.2}, other {:.2}, steal {:.0}% | {status}",
        m.agent_per_txn,
        m.agent_switches_per_txn,
        m.cores_path,
        m.cores_agent,
        m.cores_user,
        m.cores_system,
        m.cores_softirq,
        m.cores_background,
        m.steal_pct
    )
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

/// The agents' memory per idle connection (the idle workloads), one row
/// per path with agents: the largest growth over the repetitions (later
/// repetitions reuse memory freed by earlier ones, so the first is the
/// honest one and the largest).
pub fn idle_memory_table(index: &Index, placement: Placement) -> String {
    let mut md = String::new();
    for w in index
        .results
        .workloads
        .iter()
        .filter(|w| w.kind == WorkloadKind::Idle)
    {
        let _ = writeln!(
            md,
            "\n**{}** ({}): both agents of the path together\n",
            w.title, w.id
        );
        md.push_str("| path | connections held | agents' RSS before → held, MiB | growth MiB | KiB per connection | MiB per 10,000 | agents' wake-ups/s while held | verified |\n");
        md.push_str("|---|--:|--:|--:|--:|--:|--:|--:|\n");
        for &path in &index.results.paths {
            let recs = index.records(placement, &w.id, path);
            let ok = recs.iter().filter(|r| r.verified).count();
            let worst = recs
                .iter()
                .filter(|r| r.verified && r.report.agents_rss_held_kib > 0)
                .max_by_key(|r| {
                    r.report
                        .agents_rss_held_kib
                        .saturating_sub(r.report.agents_rss_before_kib)
                });
            let Some(r) = worst else {
                continue;
            };
            let held = r.report.connections.max(1);
            let grew = r
                .report
                .agents_rss_held_kib
                .saturating_sub(r.report.agents_rss_before_kib);
            let per_conn = grew as f64 / held as f64;
            let _ = writeln!(
                md,
                "| {} | {} | {:.1} → {:.1} | {:.1} | {:.2} | {:.1} | {} | {ok}/{} |",
                path_label(&path),
                r.report.connections,
                r.report.agents_rss_before_kib as f64 / 1024.0,
                r.report.agents_rss_held_kib as f64 / 1024.0,
                grew as f64 / 1024.0,
                per_conn,
                per_conn * 10_000.0 / 1024.0,
                idle_wakeups(recs),
                recs.len()
            );
        }
    }
    md
}

/// The agents' wake-ups per second while the connections were held: the
/// median over the verified repetitions, and their range ("-" for records
/// of a harness that did not count them).
fn idle_wakeups(recs: &[&Record]) -> String {
    let mut rates: Vec<f64> = recs
        .iter()
        .filter(|r| r.verified && r.report.agents_wakeups_window_s > 0.0)
        .map(|r| r.report.agents_wakeups as f64 / r.report.agents_wakeups_window_s)
        .collect();
    rates.sort_by(f64::total_cmp);
    match rates.as_slice() {
        [] => "-".to_owned(),
        [one] => format!("{one:.0}"),
        [low, .., high] => {
            let mid = rates.len() / 2;
            let median = if rates.len().is_multiple_of(2) {
                (rates[mid - 1] + rates[mid]) / 2.0
            } else {
                rates[mid]
            };
            format!("{median:.0} ({low:.0}–{high:.0})")
        }
    }
}

/// Every workload's full numbers for one placement.
pub fn detail_tables(index: &Index, placement: Placement) -> String {
    let mut md = String::new();
    for w in &index.results.workloads {
        if w.kind == WorkloadKind::Idle {
            // Memory, not speed: see idle_memory_table.
            continue;
        }
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
