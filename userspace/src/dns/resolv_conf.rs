//! The upstream resolvers, from a resolv.conf (`nameserver` lines), as the
//! glibc stub resolver reads them: the agent forwards what the mesh does not
//! know to the resolvers its own `/etc/resolv.conf` names (in a cluster:
//! the cluster DNS), as ztunnel does.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
};

use super::DnsError;

/// The port of every `nameserver` (resolv.conf cannot name another).
const DNS_PORT: u16 = 53;

/// What a resolv.conf says that the DNS proxy uses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResolvConf {
    /// `nameserver` addresses in file order, port 53.
    pub nameservers: Vec<SocketAddr>,
    /// The last `search` (or `domain`) line's domains, without trailing dots.
    pub search: Vec<String>,
}

impl ResolvConf {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Self, DnsError> {
        let text = std::fs::read_to_string(path).map_err(|source| DnsError::ResolvConf {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self::parse(&text))
    }

    /// Parses resolv.conf text. Like the stub resolver, a line it does not
    /// understand (or a `nameserver` that is not an IP address) is skipped,
    /// not an error: the file is the system's, not ours to validate.
    pub fn parse(text: &str) -> Self {
        let mut conf = ResolvConf::default();
        for line in text.lines() {
            // `#` and `;` start comments anywhere on a line.
            let line = line.split(['#', ';']).next().unwrap_or_default();
            let mut words = line.split_whitespace();
            match words.next() {
                Some("nameserver") => {
                    if let Some(ip) = words.next().and_then(parse_nameserver) {
                        conf.nameservers.push(SocketAddr::new(ip, DNS_PORT));
                    }
                }
                // The last of `search` / `domain` wins, as in glibc.
                Some("search") | Some("domain") => {
                    conf.search = words
                        .map(|d| d.trim_end_matches('.').to_ascii_lowercase())
                        .filter(|d| !d.is_empty())
                        .collect();
                }
                _ => {}
            }
        }
        conf
    }
}

/// A `nameserver` value: an IPv4 or IPv6 address; a link-local IPv6 with a
/// `%zone` is skipped (the agent cannot say which interface is meant).
fn parse_nameserver(word: &str) -> Option<IpAddr> {
    if word.contains('%') {
        return None;
    }
    word.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nameservers_in_order_with_comments_and_junk_skipped() {
        let conf = ResolvConf::parse(
            "# generated\n\
             search default.svc.cluster.local svc.cluster.local cluster.local.\n\
             nameserver 10.96.0.10 # kube-dns\n\
             nameserver fd00::a\n\
             nameserver not-an-ip\n\
             nameserver fe80::1%eth0\n\
             ; nameserver 10.0.0.99\n\
             options ndots:5\n",
        );
        assert_eq!(
            conf.nameservers,
            vec![
                "10.96.0.10:53".parse::<SocketAddr>().expect("v4"),
                "[fd00::a]:53".parse::<SocketAddr>().expect("v6"),
            ]
        );
        assert_eq!(
            conf.search,
            vec![
                "default.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local"
            ]
        );
    }

    #[test]
    fn the_last_search_line_wins_and_an_empty_file_has_no_upstream() {
        let conf = ResolvConf::parse("search a.example\ndomain b.example\n");
        assert_eq!(conf.search, vec!["b.example"]);
        assert!(ResolvConf::parse("").nameservers.is_empty());
    }

    #[test]
    fn a_missing_file_is_an_error_naming_it() {
        let err = ResolvConf::load(Path::new("/nonexistent/resolv.conf")).expect_err("missing");
        assert!(
            err.to_string().contains("/nonexistent/resolv.conf"),
            "{err}"
        );
    }
}
