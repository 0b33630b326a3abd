//! From measurements to what a reader takes in: medians and spreads per
//! path, ratios (eBPF vs iptables, vs direct) paired within each repetition
//! of the same run, the targets, the cost, and the Markdown report. Reads
//! only the model ([`crate::model::RunResults`]), so a report can be
//! written again from a run's raw JSON (`shunt-bench render`).

mod policies;
mod stats;
mod tables;
mod targets;
mod ztunnel;

use std::fmt::Write as _;

pub use policies::policies_table;
pub use stats::{
    Index, Metrics, Pick, Stat, metrics, pick_agent, pick_agent_switches, pick_cpu, pick_p50,
    pick_p90, pick_p99, pick_p999, pick_rate,
};
pub use tables::{
    cost_table, detail_tables, headline_table, human, idle_memory_table, one_line, path_label,
};
pub use targets::{
    Target, iptables_vs_direct_table, ratio_cell, target_cells, targets, targets_table,
};
pub use ztunnel::ztunnel_table;

use crate::model::{Placement, Record, RunResults};

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
        let against_ztunnel = ztunnel_table(&index, placement);
        if !against_ztunnel.is_empty() {
            let _ = writeln!(md, "\n### shunt vs ztunnel ({})\n", placement.name());
            md.push_str(&against_ztunnel);
        }
        let _ = writeln!(md, "\n### Cost ({})\n", placement.name());
        md.push_str(&cost_table(&index, placement));
        md.push_str("\nPath CPU = the cgroup `cpu.stat` usage of the path's processes (both agents of its topology, the load generator, the servers; softirq work done in their context included, as this kernel has no IRQ time accounting) plus the `ksoftirqd` threads. Cores = CPU-seconds per second of the run, of the machine's ");
        let _ = write!(md, "{}", m.cpus);
        md.push_str("; machine usr / sys / softirq is `/proc/stat` for the whole machine (usr includes nice, sys includes irq), and other work = machine busy − path, i.e. what else ran on the shared machine meanwhile.\n\n");
        md.push_str(&idle_memory_table(&index, placement));
        let _ = writeln!(
            md,
            "<details><summary>Every workload, {} placement</summary>\n",
            placement.name()
        );
        md.push_str(&detail_tables(&index, placement));
        md.push_str("\n</details>\n\n");
        if !results.policies.is_empty() {
            let _ = writeln!(
                md,
                "### Authorization policies on the destination ({})\n",
                placement.name()
            );
            md.push_str(&policies_table(results, placement));
            md.push_str("\nGenerated ALLOW policies selecting the server pods by label (`--policies`, applied through the agents' workloads files before each count's measurements); only the last names the client's principal, so every connection is checked against all of them and admitted. Medians over repetitions, ±x% = half the min–max range; the last column is the ratio of the most to the fewest policies, paired within each repetition, median (min–max). The tables above show the fewest.\n\n");
        }
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
