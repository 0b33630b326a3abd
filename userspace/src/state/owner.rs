//! What owns a pod (its Deployment, Job, CronJob, or nothing but itself),
//! as Istio names it in telemetry (`k8s.<type>.name` in `baggage`,
//! `workloadName`/`workloadType` in ztunnel's config dump).
//!
//! istiod sends it (`workload_type`, `workload_name`); the Kubernetes
//! watch derives it from the pod's controller reference the way istiod
//! does, so both sources name the same owner.

use std::fmt;

/// The kind of a workload's owner (`istio.workload.WorkloadType`).
///
/// Defaults to [`WorkloadType::Pod`]: a source that knows no owner names
/// the pod itself, which is what Istio does for a bare pod.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WorkloadType {
    Deployment,
    CronJob,
    #[default]
    Pod,
    Job,
}

impl WorkloadType {
    /// The lowercase name Istio uses (`deployment`, `cronjob`, `pod`,
    /// `job`): the `<type>` of `k8s.<type>.name`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Deployment => "deployment",
            Self::CronJob => "cronjob",
            Self::Pod => "pod",
            Self::Job => "job",
        }
    }

    /// Parses [`WorkloadType::as_str`]'s names (the workloads file's
    /// `workloadType`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "deployment" => Some(Self::Deployment),
            "cronjob" => Some(Self::CronJob),
            "pod" => Some(Self::Pod),
            "job" => Some(Self::Job),
            _ => None,
        }
    }
}

impl fmt::Display for WorkloadType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the node proxy wraps what it delivers to a workload
/// (`istio.workload.ApplicationTunnel`). Stored for later use; the proxy
/// does not act on it yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ApplicationTunnel {
    pub protocol: ApplicationTunnelProtocol,
    /// 0: the port the connection was for.
    pub port: u16,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ApplicationTunnelProtocol {
    /// The plain connection.
    #[default]
    None,
    /// A PROXY protocol header first.
    Proxy,
}

/// The owner of pod `pod_name`, from its controller reference (`kind`,
/// `name`) and its `pod-template-hash` label, as istiod derives it:
///
/// - a ReplicaSet whose name is `<deployment>-<pod-template-hash>` is a
///   Deployment's, named without the hash;
/// - a Job named `<cronjob>-<8 to 10 digits>` (the scheduled time) is a
///   CronJob's, named without the suffix; any other Job is the Job;
/// - anything else (StatefulSet, DaemonSet, a bare ReplicaSet, no
///   controller) is the pod itself.
pub fn pod_owner(
    pod_name: &str,
    controller: Option<(&str, &str)>,
    pod_template_hash: Option<&str>,
) -> (WorkloadType, String) {
    let pod = (WorkloadType::Pod, pod_name.to_owned());
    let Some((kind, name)) = controller else {
        return pod;
    };
    match kind {
        "ReplicaSet" => match pod_template_hash.filter(|h| !h.is_empty()) {
            Some(hash) => match name.strip_suffix(hash).and_then(|n| n.strip_suffix('-')) {
                Some(deployment) if !deployment.is_empty() => {
                    (WorkloadType::Deployment, deployment.to_owned())
                }
                _ => pod,
            },
            None => pod,
        },
        "Job" => match cron_job_name(name) {
            Some(cron) => (WorkloadType::CronJob, cron.to_owned()),
            None => (WorkloadType::Job, name.to_owned()),
        },
        _ => pod,
    }
}

/// `name` without a `-<8..=10 digits>` suffix, if it has one (the
/// CronJob controller names its Jobs `<cronjob>-<scheduled minutes>`).
fn cron_job_name(name: &str) -> Option<&str> {
    let (base, suffix) = name.rsplit_once('-')?;
    let digits = (8..=10).contains(&suffix.len()) && suffix.bytes().all(|b| b.is_ascii_digit());
    (digits && !base.is_empty()).then_some(base)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_named_as_istiod_names_them() {
        let cases = [
            (
                Some(("ReplicaSet", "ratings-v1-5d8f7b9c4")),
                Some("5d8f7b9c4"),
                (WorkloadType::Deployment, "ratings-v1"),
            ),
            // A ReplicaSet not made by a Deployment (no matching hash).
            (
                Some(("ReplicaSet", "standalone")),
                Some("abc"),
                (WorkloadType::Pod, "ratings-v1-5d8f7b9c4-x2x7q"),
            ),
            (
                Some(("ReplicaSet", "standalone")),
                None,
                (WorkloadType::Pod, "ratings-v1-5d8f7b9c4-x2x7q"),
            ),
            (
                Some(("Job", "backup-28472940")),
                None,
                (WorkloadType::CronJob, "backup"),
            ),
            (
                Some(("Job", "migrate-42")),
                None,
                (WorkloadType::Job, "migrate-42"),
            ),
            (
                Some(("StatefulSet", "db")),
                None,
                (WorkloadType::Pod, "ratings-v1-5d8f7b9c4-x2x7q"),
            ),
            (
                None,
                None,
                (WorkloadType::Pod, "ratings-v1-5d8f7b9c4-x2x7q"),
            ),
        ];
        for (controller, hash, (kind, name)) in cases {
            assert_eq!(
                pod_owner("ratings-v1-5d8f7b9c4-x2x7q", controller, hash),
                (kind, name.to_owned()),
                "{controller:?} {hash:?}"
            );
        }
    }

    #[test]
    fn type_names_round_trip() {
        for t in [
            WorkloadType::Deployment,
            WorkloadType::CronJob,
            WorkloadType::Pod,
            WorkloadType::Job,
        ] {
            assert_eq!(WorkloadType::from_name(t.as_str()), Some(t));
        }
        assert_eq!(WorkloadType::from_name("Deployment"), None);
        assert_eq!(WorkloadType::default().to_string(), "pod");
    }
}
