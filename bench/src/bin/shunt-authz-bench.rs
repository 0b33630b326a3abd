//! What the authorization check costs the proxy per connection: the
//! engine's verdict (`PolicySet::check`) for a destination guarded by 0, 10
//! and 1,000 AuthorizationPolicies, the same shape `shunt-bench run
//! --policies` applies (ALLOW by principal, selecting the server by label;
//! only the last admits the client, and every applicable policy is looked
//! at on every check). No kernel, no root:
//!
//! `cargo run --release -p shunt-bench --bin shunt-authz-bench [-- --counts 0,10,1000 --seconds 1]`
//!
//! Prints ns per check (the median of 5 timed runs of `--seconds` / 5 each).

use std::{collections::BTreeMap, hint::black_box, net::SocketAddr, time::Instant};

use clap::Parser;
use shunt::authz::{
    Action, Clause, Connection, Destination, Match, Policy, PolicySet, Rule, Scope, StringMatch,
    Verdict,
};

#[derive(Parser)]
struct Args {
    /// Numbers of policies on the destination.
    #[arg(long, value_delimiter = ',', default_value = "0,10,1000")]
    counts: Vec<usize>,
    /// Time spent measuring each count.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
}

const CLIENT: &str = "spiffe://cluster.local/ns/default/sa/sa-client";

fn policies(count: usize, labels: &BTreeMap<String, String>) -> Vec<Policy> {
    (0..count)
        .map(|i| {
            let principal = if i + 1 == count {
                "cluster.local/ns/default/sa/sa-client".to_string()
            } else {
                format!("cluster.local/ns/default/sa/not-the-client-{i:04}")
            };
            Policy {
                name: format!("bench-{i:04}"),
                namespace: "default".into(),
                scope: Scope::WorkloadSelector,
                action: Action::Allow,
                rules: vec![Rule {
                    clauses: vec![Clause {
                        matches: vec![Match {
                            principals: vec![StringMatch::Exact(principal)],
                            ..Default::default()
                        }],
                    }],
                }],
                dry_run: false,
                selector: Some(labels.clone()),
            }
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let labels: BTreeMap<String, String> = [("app".to_string(), "bench-server".to_string())].into();
    let dst: SocketAddr = "198.18.2.10:9000".parse()?;
    let connection = Connection {
        src_ip: "198.18.1.10".parse()?,
        src_identity: Some(CLIENT),
        dst,
    };
    let destination = Destination {
        namespace: "default",
        labels: &labels,
        authorization_policies: &[],
    };
    println!("| policies on the destination | verdict | ns per check |");
    println!("|--:|---|--:|");
    for &count in &args.counts {
        let set = PolicySet::new(policies(count, &labels));
        let verdict = set.check(&connection, destination);
        let allowed = matches!(verdict, Verdict::Allowed(_) | Verdict::AllowedWithoutPolicy);
        anyhow::ensure!(
            allowed,
            "{count} policies: the client is not allowed ({verdict:?})"
        );
        // Calibrate: how many checks fit in a fifth of the time.
        let slice = args.seconds / 5.0;
        let mut batch = 1u64;
        loop {
            let start = Instant::now();
            for _ in 0..batch {
                black_box(set.check(black_box(&connection), black_box(destination)));
            }
            if start.elapsed().as_secs_f64() >= slice / 10.0 || batch >= 1 << 40 {
                let per = start.elapsed().as_secs_f64() / batch as f64;
                batch = ((slice / per.max(1e-12)) as u64).max(1);
                break;
            }
            batch *= 2;
        }
        let mut runs: Vec<f64> = (0..5)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..batch {
                    black_box(set.check(black_box(&connection), black_box(destination)));
                }
                start.elapsed().as_secs_f64() * 1e9 / batch as f64
            })
            .collect();
        runs.sort_by(f64::total_cmp);
        let kind = match verdict {
            Verdict::AllowedWithoutPolicy => "allowed (no policy)".to_string(),
            Verdict::Allowed(key) => format!("allowed by {key}"),
            other => format!("{other:?}"),
        };
        println!("| {count} | {kind} | {:.0} |", runs[2]);
    }
    Ok(())
}
