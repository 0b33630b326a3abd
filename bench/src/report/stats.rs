//! Numbers out of measurements: what one measurement says ([`Metrics`]),
//! median/min/max of repetitions ([`Stat`]), and the run indexed by
//! placement, workload and path, with ratios paired per repetition
//! ([`Index::ratio`]).

use std::collections::BTreeMap;

use hdrhistogram::Histogram;

use crate::{
    client::{WorkloadKind, new_histogram},
    model::{PathSpec, Placement, Record, RunResults, Workload},
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
    /// The agents' context switches per transaction (per connection for
    /// `crr`; stream: per MB).
    pub agent_switches_per_txn: f64,
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
        agent_switches_per_txn: if per_unit > 0.0 {
            r.cost.agents_switches as f64
                / per_unit
                / if kind == WorkloadKind::Stream {
                    1e3
                } else {
                    1.0
                }
        } else {
            0.0
        },
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

pub(super) fn histogram(pairs: &[(u64, u64)]) -> Option<Histogram<u64>> {
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
pub fn pick_agent_switches(m: &Metrics) -> Option<f64> {
    Some(m.agent_switches_per_txn)
}

/// The measurements of a run, indexed.
pub struct Index<'a> {
    pub results: &'a RunResults,
    by_key: BTreeMap<(Placement, String, PathSpec), Vec<&'a Record>>,
}

impl<'a> Index<'a> {
    pub fn new(results: &'a RunResults) -> Index<'a> {
        let mut by_key: BTreeMap<_, Vec<&Record>> = BTreeMap::new();
        // A run that varied the policies on the destination (`--policies`)
        // shows its fewest here; `policies_table` shows them all.
        let baseline = results.policies.iter().min().copied();
        for r in results.records.iter().filter(|r| r.policies == baseline) {
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
