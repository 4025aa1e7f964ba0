//! The InternalIPs of the cluster's Nodes as the peer listener and peer restores need them: one
//! Node at a time, fetched when first asked for and kept for a jittered TTL.
//!
//! Peer fetches are rare and name one Node each (the certificate's `system:node:<name>`, or the
//! tag's pushing node), so a `GET nodes/<name>` on demand replaces listing the whole cluster on
//! a timer, which costs the API server O(nodes²) across a fleet. A name that is unknown (no
//! such Node, no InternalIP, or the API server failing with nothing known) is remembered for a
//! short negative TTL, so a caller repeating a bad name cannot make this node hammer the API
//! server. The lookup blocks its caller: it runs on the listener's connection threads and the
//! transfer pool, never on the loop.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backoff::Jitter;
use crate::kube::Client;

/// How long a Node's InternalIP is trusted before it is fetched again (drawn from [T, 1.5 T)
/// per entry, so one node's re-fetches of many peers do not fall into step).
pub const NODE_TTL: Duration = Duration::from_secs(300);
/// How long a name that found no usable Node is answered "unknown" without asking again.
pub const UNKNOWN_TTL: Duration = Duration::from_secs(10);

/// Fetches one Node's InternalIP: `Ok(None)` when there is no such Node or it has none.
pub type NodeLookup = Arc<dyn Fn(&str) -> Result<Option<IpAddr>, String> + Send + Sync>;

/// The lookup against the API server: `GET /api/v1/nodes/<name>`.
pub fn api_lookup(kube: Arc<Client>) -> NodeLookup {
    Arc::new(move |name: &str| {
        if !plain_node_name(name) {
            return Ok(None);
        }
        match kube.node_internal_ip(name) {
            Ok(ip) => Ok(ip),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    })
}

/// A Node name as the API server accepts it (a DNS subdomain): anything else is not looked up,
/// and cannot reach the request path.
fn plain_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

/// The cached lookups, shared by the listener's connection threads and the restore jobs.
pub struct ClusterNodes {
    lookup: NodeLookup,
    ttl: Duration,
    unknown_ttl: Duration,
    state: Mutex<State>,
}

struct State {
    entries: HashMap<String, Entry>,
    /// One lock per name being fetched: concurrent connections of one peer (a restore opens
    /// several slice streams at once) wait for one GET instead of each making its own.
    fetching: HashMap<String, Arc<Mutex<()>>>,
    jitter: Jitter,
}

#[derive(Clone, Copy)]
struct Entry {
    /// None: unknown (negative entry).
    ip: Option<IpAddr>,
    fresh_until: Instant,
}

impl std::fmt::Debug for ClusterNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNodes")
            .field("ttl", &self.ttl)
            .field("unknown_ttl", &self.unknown_ttl)
            .finish_non_exhaustive()
    }
}

impl ClusterNodes {
    /// Lookups cached for `NODE_TTL` (jittered), unknown names for `UNKNOWN_TTL`.
    pub fn new(lookup: NodeLookup) -> ClusterNodes {
        ClusterNodes::with_ttls(lookup, NODE_TTL, UNKNOWN_TTL)
    }

    pub fn with_ttls(lookup: NodeLookup, ttl: Duration, unknown_ttl: Duration) -> ClusterNodes {
        ClusterNodes {
            lookup,
            ttl,
            unknown_ttl,
            state: Mutex::new(State {
                entries: HashMap::new(),
                fetching: HashMap::new(),
                jitter: Jitter::new(0x6e6f_6465),
            }),
        }
    }

    /// Node `node`'s InternalIP (IPv4-mapped IPv6 as IPv4), from the cache while it is fresh,
    /// else fetched (blocking). When a re-fetch fails the last known address stays in use
    /// until the next attempt, `UNKNOWN_TTL` later: a flapping API server must neither open
    /// the listener to new addresses nor close it to the known nodes.
    pub fn internal_ip(&self, node: &str) -> Option<IpAddr> {
        if let Some(known) = self.fresh(node) {
            return known;
        }
        let gate = {
            let mut s = self.state.lock().ok()?;
            s.fetching.entry(node.to_string()).or_default().clone()
        };
        let held = gate.lock();
        // Another thread may have fetched it while this one waited.
        let answer = match self.fresh(node) {
            Some(known) => known,
            None => self.fetch(node),
        };
        drop(held);
        if let Ok(mut s) = self.state.lock() {
            if s.fetching
                .get(node)
                .is_some_and(|g| Arc::ptr_eq(g, &gate) && Arc::strong_count(g) <= 2)
            {
                s.fetching.remove(node);
            }
        }
        answer
    }

    /// The cached answer while it is fresh (Some(None): known to be unknown).
    fn fresh(&self, node: &str) -> Option<Option<IpAddr>> {
        let s = self.state.lock().ok()?;
        s.entries
            .get(node)
            .filter(|e| Instant::now() < e.fresh_until)
            .map(|e| e.ip)
    }

    fn fetch(&self, node: &str) -> Option<IpAddr> {
        let fetched = (self.lookup)(node);
        let now = Instant::now();
        let mut s = self.state.lock().ok()?;
        let last = s.entries.get(node).and_then(|e| e.ip);
        let ip = match fetched {
            Ok(Some(ip)) => {
                let ttl = self.ttl + self.ttl.mul_f64(s.jitter.unit() / 2.0);
                let ip = canonical(ip);
                s.entries.insert(
                    node.to_string(),
                    Entry {
                        ip: Some(ip),
                        fresh_until: now + ttl,
                    },
                );
                return Some(ip);
            }
            Ok(None) => None,
            Err(e) => {
                log::warn!("peer: looking up Node {node}: {e}");
                last
            }
        };
        // Unknown, or kept on a failed re-fetch: asked again no sooner than `unknown_ttl`.
        s.entries.insert(
            node.to_string(),
            Entry {
                ip,
                fresh_until: now + self.unknown_ttl,
            },
        );
        ip
    }
}

/// IPv4-mapped IPv6 addresses compare as their IPv4 form.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// What the fake lookup answers per name.
    type Answers = Arc<Mutex<HashMap<String, Result<Option<IpAddr>, String>>>>;

    fn counting(table: Answers) -> (NodeLookup, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let lookup: NodeLookup = Arc::new(move |name: &str| {
            c.fetch_add(1, Ordering::SeqCst);
            table.lock().unwrap().get(name).cloned().unwrap_or(Ok(None))
        });
        (lookup, calls)
    }

    #[test]
    fn a_failed_refetch_keeps_the_last_address_until_the_next_attempt() {
        let ip: IpAddr = "10.0.0.2".parse().unwrap();
        let table = Arc::new(Mutex::new(HashMap::from([(
            "node-b".to_string(),
            Ok(Some(ip)),
        )])));
        let (lookup, calls) = counting(table.clone());
        let nodes =
            ClusterNodes::with_ttls(lookup, Duration::from_millis(20), Duration::from_millis(20));
        assert_eq!(nodes.internal_ip("node-b"), Some(ip));
        table
            .lock()
            .unwrap()
            .insert("node-b".into(), Err("connection refused".into()));
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(nodes.internal_ip("node-b"), Some(ip));
        assert_eq!(nodes.internal_ip("node-b"), Some(ip));
        assert_eq!(calls.load(Ordering::SeqCst), 2, "one re-fetch, then cached");
    }

    #[test]
    fn concurrent_lookups_of_one_name_make_one_request() {
        let ip: IpAddr = "::ffff:10.0.0.3".parse().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let lookup: NodeLookup = Arc::new(move |_: &str| {
            c.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(50));
            Ok(Some(ip))
        });
        let nodes = Arc::new(ClusterNodes::new(lookup));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let n = nodes.clone();
                std::thread::spawn(move || n.internal_ip("node-c"))
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), Some("10.0.0.3".parse().unwrap()));
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn names_the_api_server_would_refuse_are_not_looked_up() {
        assert!(plain_node_name("node-b.example.com"));
        for bad in ["", "Node", "a/b", "a?b", "../x", &"a".repeat(254)] {
            assert!(!plain_node_name(bad), "{bad}");
        }
    }
}
