//! Resolving a service endpoint that istiod names by DNS name instead of
//! address (a `resolution: DNS` ServiceEntry's endpoints, or its hosts
//! when it lists none), when a connection to the service picks it, as
//! ztunnel's on-demand DNS does (`state.rs`, `resolve_on_demand_dns`).
//!
//! The agent's own resolver does it — hickory's stub resolver, configured
//! from the agent's resolv.conf (`--dns-resolv-conf`: search list, ndots,
//! timeouts as the file says), answers cached by their TTL — from the
//! agent's netns, as ztunnel resolves from its own pod, not the client's.
//!
//! hickory keeps its own `tokio::time` timers (each query's timeout), which
//! the data path's shards cannot hold (no time driver, `shards.rs`): a
//! lookup runs on the runtime the resolver was made on (the control
//! runtime), and the connection's task waits for its answer.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    time::Duration,
};

use hickory_resolver::{
    TokioResolver,
    config::{LookupIpStrategy, ResolverConfig, ResolverOpts},
    net::runtime::TokioRuntimeProvider,
    system_conf::parse_resolv_conf,
};

use super::DnsError;

/// ztunnel's cache size for on-demand answers (hickory's default is 32).
const CACHE_SIZE: u64 = 4096;

/// Why a hostname endpoint gave no address (the connection fails).
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("cannot resolve {hostname}: {reason}")]
    Lookup { hostname: String, reason: String },
    #[error("{hostname} resolved to no address")]
    NoAddress { hostname: String },
}

/// The agent's stub resolver for hostname endpoints. Cheap to share.
#[derive(Clone, Debug)]
pub struct OnDemandResolver {
    resolver: TokioResolver,
    /// Where lookups run; the caller's runtime when made outside one.
    runtime: Option<tokio::runtime::Handle>,
}

impl OnDemandResolver {
    /// Configured from the resolv.conf at `path` (as ztunnel reads the
    /// system's). Both families are asked for; [`Self::resolve`] picks.
    pub fn from_resolv_conf(path: &Path, timeout: Duration) -> Result<Self, DnsError> {
        let unreadable = |source| DnsError::ResolvConf {
            path: path.to_path_buf(),
            source,
        };
        let text = std::fs::read(path).map_err(unreadable)?;
        let (config, options) = parse_resolv_conf(&text).map_err(|e| {
            unreadable(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                e.to_string(),
            ))
        })?;
        Self::new(config, options, timeout)
    }

    /// A resolver that knows no upstream: every lookup fails (the agent's
    /// resolv.conf was unreadable).
    pub fn without_upstream(timeout: Duration) -> Result<Self, DnsError> {
        let none = ResolverConfig::from_name_servers(Vec::new());
        Self::new(none, ResolverOpts::default(), timeout)
    }

    fn new(
        config: ResolverConfig,
        mut options: ResolverOpts,
        timeout: Duration,
    ) -> Result<Self, DnsError> {
        options.cache_size = CACHE_SIZE;
        // Both families at once: the pick below prefers the connection's
        // (ztunnel's choice when IPv6 is enabled).
        options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        // One query's wait no longer than a forwarded one's.
        options.timeout = options.timeout.min(timeout);
        let resolver = TokioResolver::builder_with_config(config, TokioRuntimeProvider::default())
            .with_options(options)
            .build()
            .map_err(|e| DnsError::Resolver(e.to_string()))?;
        Ok(Self {
            resolver,
            runtime: tokio::runtime::Handle::try_current().ok(),
        })
    }

    /// An address of `hostname` for a connection the client made to
    /// `dialled`: one of its family when it has one, else any; chosen at
    /// random among them, as ztunnel chooses.
    pub async fn resolve(
        &self,
        hostname: &str,
        dialled: SocketAddr,
    ) -> Result<IpAddr, ResolveError> {
        let failed = |reason: String| ResolveError::Lookup {
            hostname: hostname.to_owned(),
            reason,
        };
        let (resolver, name) = (self.resolver.clone(), hostname.to_owned());
        let found = crate::shards::spawn_on(self.runtime.as_ref(), async move {
            resolver.lookup_ip(name).await
        })
        .await
        .map_err(|e| failed(format!("the lookup's task ended: {e}")))?
        .map_err(|e| failed(e.to_string()))?;
        let addresses: Vec<IpAddr> = found.iter().collect();
        pick(&addresses, dialled.is_ipv6(), random_index).ok_or_else(|| ResolveError::NoAddress {
            hostname: hostname.to_owned(),
        })
    }
}

/// One of `addresses`, of the dialled family (`v6`) when there is one;
/// `index(n)` chooses among `n`.
fn pick(addresses: &[IpAddr], v6: bool, index: impl Fn(usize) -> usize) -> Option<IpAddr> {
    let matching: Vec<IpAddr> = addresses
        .iter()
        .copied()
        .filter(|a| a.is_ipv6() == v6)
        .collect();
    let from = if matching.is_empty() {
        addresses.to_vec()
    } else {
        matching
    };
    if from.is_empty() {
        return None;
    }
    from.get(index(from.len()) % from.len()).copied()
}

/// A random index below `n` (spreads connections over a name's
/// addresses; a failing random source picks the first).
fn random_index(n: usize) -> usize {
    use ring::rand::{SecureRandom, SystemRandom};
    let mut bytes = [0u8; 4];
    let _ = SystemRandom::new().fill(&mut bytes);
    u32::from_ne_bytes(bytes) as usize % n.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn the_dialled_family_is_preferred_and_any_other_taken_when_alone() {
        let both = [ip("198.18.5.1"), ip("2001:db8::1"), ip("198.18.5.2")];
        assert_eq!(pick(&both, false, |_| 1), Some(ip("198.18.5.2")));
        assert_eq!(pick(&both, true, |_| 1), Some(ip("2001:db8::1")));
        assert_eq!(
            pick(&[ip("2001:db8::1")], false, |_| 0),
            Some(ip("2001:db8::1"))
        );
        assert_eq!(pick(&[], false, |_| 0), None);
    }

    #[test]
    fn the_choice_spreads_over_every_address_of_the_family() {
        let v4 = [ip("198.18.5.1"), ip("198.18.5.2"), ip("198.18.5.3")];
        let chosen: std::collections::BTreeSet<IpAddr> =
            (0..3).filter_map(|i| pick(&v4, false, |_| i)).collect();
        assert_eq!(chosen.len(), 3);
    }

    #[tokio::test]
    async fn a_resolver_without_upstream_fails_with_the_name() {
        let resolver =
            OnDemandResolver::without_upstream(Duration::from_secs(1)).expect("resolver");
        let err = resolver
            .resolve("api.example.test", "198.18.0.1:80".parse().expect("addr"))
            .await
            .expect_err("no upstream");
        assert!(err.to_string().contains("api.example.test"), "{err}");
    }

    /// A lookup asked for on a data-path shard, which has no time driver,
    /// runs where the resolver was made: hickory's query timeout fires
    /// there (an upstream that never answers) instead of panicking the
    /// connection's task.
    #[test]
    fn a_lookup_from_a_runtime_without_timers_runs_on_the_resolvers() {
        use hickory_resolver::config::NameServerConfig;
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let port = silent.local_addr().expect("addr").port();
        let mut server = NameServerConfig::udp(ip("127.0.0.1"));
        for connection in &mut server.connections {
            connection.port = port;
        }
        let mut options = ResolverOpts::default();
        options.attempts = 1;
        let control = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("control runtime");
        let resolver = control
            .block_on(async {
                OnDemandResolver::new(
                    ResolverConfig::from_name_servers(vec![server]),
                    options,
                    Duration::from_millis(200),
                )
            })
            .expect("resolver");
        let shard = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("a runtime without a time driver");
        let outcome = shard.block_on(async {
            // Spawned, as a connection's task is: a panic would end it.
            tokio::spawn(async move {
                resolver
                    .resolve("api.example.test.", "198.18.0.1:80".parse().expect("addr"))
                    .await
                    .map_err(|e| e.to_string())
            })
            .await
        });
        let failed = outcome
            .expect("the connection's task ended without a panic")
            .expect_err("nobody answers");
        assert!(failed.contains("api.example.test"), "{failed}");
        drop(silent);
    }

    #[test]
    fn a_resolv_conf_that_cannot_be_read_is_named() {
        let err = OnDemandResolver::from_resolv_conf(
            Path::new("/nonexistent/resolv.conf"),
            Duration::from_secs(1),
        )
        .expect_err("missing");
        assert!(
            err.to_string().contains("/nonexistent/resolv.conf"),
            "{err}"
        );
    }
}
