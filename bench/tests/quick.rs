//! `shunt-bench run --quick` end to end on the real kernel: every path and
//! workload runs once, in both placements, and each must have moved its
//! bytes intact through the path it claims (the proxies' counters account
//! for every connection on mesh paths). Never asserts a speed.

use std::{path::PathBuf, process::Command};

use shunt_bench::model::{Mode, PathSpec, RunResults, workloads};
use shunt_testbed::require_root;

#[test]
fn quick_run_moves_verified_bytes_on_every_path() {
    require_root().expect("the benchmark needs root");
    let shunt = shunt_testbed::agent::shunt_binary().expect("shunt binary");
    let out: PathBuf =
        std::env::temp_dir().join(format!("shunt-bench-quick-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let output = Command::new(env!("CARGO_BIN_EXE_shunt-bench"))
        .args(["run", "--quick", "--name", "quick"])
        .arg("--out")
        .arg(&out)
        .arg("--shunt")
        .arg(&shunt)
        .output()
        .expect("run shunt-bench");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let raw = std::fs::read_to_string(out.join("quick.json"))
        .unwrap_or_else(|e| panic!("no results ({e}); shunt-bench said:\n{stderr}"));
    let results: RunResults = serde_json::from_str(&raw).expect("results parse");

    let paths = PathSpec::all();
    assert_eq!(results.paths, paths, "every path ran");
    let expected = paths.len() * workloads(true).len() * results.placements.len();
    assert_eq!(results.records.len(), expected, "{stderr}");
    for record in &results.records {
        let what = format!(
            "{} {} {}: {:?}",
            record.placement.name(),
            record.workload,
            record.path_id,
            record.problems
        );
        let report = &record.report;
        assert!(report.ok && report.intact, "{what}");
        assert!(report.bytes_sent > 0 && report.bytes_received > 0, "{what}");
        assert!(report.txns > 0, "{what}");
        match record.path.mode {
            Mode::Direct => assert!(record.proxy.is_none(), "{what}"),
            // Around the proxy: it must have carried nothing.
            Mode::EbpfFastPath => {
                let proxy = record.proxy.as_ref().expect("proxy counters");
                assert_eq!(proxy.client_side, 0, "{what}");
                assert_eq!(proxy.bytes_out, 0, "{what}");
            }
            _ => {
                let proxy = record.proxy.as_ref().expect("proxy counters");
                assert!(proxy.client_side >= report.connections, "{what}");
                assert!(proxy.bytes_out >= report.bytes_sent, "{what}");
                assert_eq!(proxy.refused + proxy.failed, 0, "{what}");
            }
        }
        assert!(record.verified, "{what}");
    }
    assert!(output.status.success(), "shunt-bench failed:\n{stderr}");

    let md = std::fs::read_to_string(out.join("quick.md")).expect("report");
    let svg = std::fs::read_to_string(out.join("quick.svg")).expect("chart");
    for path in &paths {
        let label = shunt_bench::report::path_label(path);
        assert!(md.contains(&label), "report lacks {label}");
        assert!(svg.contains(&label), "chart lacks {label}");
    }
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));

    // The report is re-derived from the JSON alone, byte for byte.
    let again = out.join("again");
    std::fs::create_dir_all(&again).expect("dir");
    let render = Command::new(env!("CARGO_BIN_EXE_shunt-bench"))
        .arg("render")
        .arg(out.join("quick.json"))
        .arg("--out")
        .arg(&again)
        .output()
        .expect("run shunt-bench render");
    assert!(render.status.success(), "{render:?}");
    assert_eq!(
        std::fs::read_to_string(again.join("quick.md")).expect("rendered report"),
        md,
        "render from quick.json differs from the run's report"
    );
    assert_eq!(
        std::fs::read_to_string(again.join("quick.svg")).expect("rendered chart"),
        svg
    );
    let _ = std::fs::remove_dir_all(&out);
}
