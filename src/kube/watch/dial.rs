//! The watch's dialer: resolves the API server's name and opens the TCP connection on a thread
//! of its own, so the loop never waits for a name lookup or a handshake; keeps the addresses.
//!
//! Every address the name resolves to is tried in the resolver's order, each for at most the
//! per-address timeout: a refused, unreachable or silent address moves on to the next (a
//! `localhost` that answers ::1 first while the server listens on 127.0.0.1 only still gets its
//! watch). The finished dial wakes the loop through a socket pair registered under the watch's
//! own token, so the loop sees it as watch readiness.
//!
//! std's resolver tells no TTL, so an answer is kept for [`ADDRESS_TTL`] and dropped at once when
//! a connection through it fails: an API server that moved is looked up again at the next try.

use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mio::{Interest, Registry, Token};

/// Turns a host name and port into the addresses to try, in order. Called on the dial thread,
/// never on the loop's.
pub type Resolver = Arc<dyn Fn(&str, u16) -> io::Result<Vec<SocketAddr>> + Send + Sync>;

/// How long a resolved answer is used before the name is looked up again. std's resolver gives
/// no TTL: 30 s follows a re-pointed name soon after it moves while a storm of reconnects
/// (each failure also drops the answer) asks the resolver at most once per attempt.
pub const ADDRESS_TTL: Duration = Duration::from_secs(30);

/// Longest wait for one address to accept before the next is tried.
pub const PER_ADDRESS_TIMEOUT: Duration = Duration::from_secs(3);

/// The system resolver (getaddrinfo through std), for host names that are not IP literals.
pub fn system_resolver() -> Resolver {
    Arc::new(|host: &str, port: u16| {
        debug_assert!(
            !crate::reactor::on_loop_thread(),
            "name lookup of {host} on the event loop's thread"
        );
        Ok((host, port).to_socket_addrs()?.collect())
    })
}

/// A resolved answer and when it was got.
struct Cached {
    host: String,
    port: u16,
    addrs: Vec<SocketAddr>,
    at: Instant,
}

/// Resolution and connection for one watch; its address cache outlives connections.
pub(super) struct Dialer {
    resolver: Resolver,
    cache: Arc<Mutex<Option<Cached>>>,
}

impl Default for Dialer {
    fn default() -> Self {
        Dialer {
            resolver: system_resolver(),
            cache: Arc::new(Mutex::new(None)),
        }
    }
}

/// A dial under way: its answer, and the loop's end of the socket pair that wakes it.
pub(super) struct Dialing {
    answer: Receiver<Result<TcpStream, String>>,
    wake: mio::net::UnixStream,
}

impl Dialer {
    pub(super) fn set_resolver(&mut self, resolver: Resolver) {
        self.resolver = resolver;
        self.forget();
    }

    /// Drops the cached answer: the next dial resolves again.
    pub(super) fn forget(&self) {
        *lock(&self.cache) = None;
    }

    /// Starts dialling `host:port` on a new thread; its end wakes `token` on `registry`.
    pub(super) fn start(
        &self,
        host: &str,
        port: u16,
        per_address: Duration,
        registry: Option<&Registry>,
        token: Token,
    ) -> io::Result<Dialing> {
        let (mut wake, signal) = mio::net::UnixStream::pair()?;
        if let Some(reg) = registry {
            reg.register(&mut wake, token, Interest::READABLE)?;
        }
        let (tx, answer) = mpsc::channel();
        let resolver = Arc::clone(&self.resolver);
        let cache = Arc::clone(&self.cache);
        let host = host.to_string();
        let spawned = std::thread::Builder::new()
            .name("vk-watch-dial".into())
            .spawn(move || {
                let result = dial(&resolver, &cache, &host, port, per_address);
                // Answer first, then wake: the woken loop always finds the answer.
                let _ = tx.send(result);
                let _ = (&signal).write_all(&[1]);
            });
        if let Err(e) = spawned {
            if let Some(reg) = registry {
                let _ = reg.deregister(&mut wake);
            }
            return Err(e);
        }
        Ok(Dialing { answer, wake })
    }
}

impl Dialing {
    /// The dial's outcome once it has one (the connected stream or why none).
    pub(super) fn outcome(&mut self) -> Option<Result<TcpStream, String>> {
        match self.answer.try_recv() {
            Ok(result) => Some(result),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(Err("dial thread ended without answer".into())),
        }
    }

    /// Takes the wake socket out of the poll (before the token goes to the connection).
    pub(super) fn deregister(&mut self, registry: Option<&Registry>) {
        if let Some(reg) = registry {
            let _ = reg.deregister(&mut self.wake);
        }
    }
}

fn lock(cache: &Mutex<Option<Cached>>) -> std::sync::MutexGuard<'_, Option<Cached>> {
    match cache.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// The addresses of `host:port`: an IP literal as it is, else the cached answer while it is
/// fresh, else the resolver's (then cached).
fn addresses(
    resolver: &Resolver,
    cache: &Mutex<Option<Cached>>,
    host: &str,
    port: u16,
) -> Result<Vec<SocketAddr>, String> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    if let Some(c) = lock(cache).as_ref() {
        if c.host == host && c.port == port && c.at.elapsed() < ADDRESS_TTL {
            return Ok(c.addrs.clone());
        }
    }
    let addrs = resolver(host, port).map_err(|e| format!("resolve {host}: {e}"))?;
    if addrs.is_empty() {
        return Err(format!("resolve {host}: no address"));
    }
    *lock(cache) = Some(Cached {
        host: host.to_string(),
        port,
        addrs: addrs.clone(),
        at: Instant::now(),
    });
    Ok(addrs)
}

/// Resolves and connects to the first address that accepts; every failure is in the error.
fn dial(
    resolver: &Resolver,
    cache: &Mutex<Option<Cached>>,
    host: &str,
    port: u16,
    per_address: Duration,
) -> Result<TcpStream, String> {
    let addrs = addresses(resolver, cache, host, port)?;
    let mut failures = Vec::new();
    for addr in &addrs {
        match TcpStream::connect_timeout(addr, per_address) {
            Ok(stream) => {
                if !failures.is_empty() {
                    log::debug!(
                        "pod watch: {host} reached at {addr} after {}",
                        failures.join("; ")
                    );
                }
                return Ok(stream);
            }
            Err(e) => failures.push(format!("{addr}: {e}")),
        }
    }
    *lock(cache) = None;
    Err(format!("connect {host}:{port}: {}", failures.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn counting(addrs: Vec<SocketAddr>, calls: Arc<AtomicUsize>) -> Resolver {
        Arc::new(move |_, _| {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(addrs.clone())
        })
    }

    /// A closed port on loopback: bound once, then released.
    fn refusing() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }

    #[test]
    fn a_refusing_first_address_moves_on_to_the_next() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let good = listener.local_addr().unwrap();
        let bad = refusing();
        let calls = Arc::new(AtomicUsize::new(0));
        let resolver = counting(vec![bad, good], calls.clone());
        let cache = Mutex::new(None);
        let s = dial(
            &resolver,
            &cache,
            "api.test",
            good.port(),
            PER_ADDRESS_TIMEOUT,
        )
        .unwrap();
        assert_eq!(s.peer_addr().unwrap(), good);
        // The answer is cached: the next dial does not resolve again.
        dial(
            &resolver,
            &cache,
            "api.test",
            good.port(),
            PER_ADDRESS_TIMEOUT,
        )
        .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_dial_where_every_address_fails_names_each_and_forgets_the_answer() {
        let (a, b) = (refusing(), refusing());
        let calls = Arc::new(AtomicUsize::new(0));
        let resolver = counting(vec![a, b], calls.clone());
        let cache = Mutex::new(None);
        let e = dial(&resolver, &cache, "api.test", 1, PER_ADDRESS_TIMEOUT).unwrap_err();
        assert!(
            e.contains(&a.to_string()) && e.contains(&b.to_string()),
            "{e}"
        );
        assert!(lock(&cache).is_none());
        let _ = dial(&resolver, &cache, "api.test", 1, PER_ADDRESS_TIMEOUT);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "looked up again after the failure"
        );
    }

    #[test]
    fn an_answer_older_than_the_ttl_or_for_another_name_is_looked_up_again() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let good = listener.local_addr().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let resolver = counting(vec![good], calls.clone());
        let cache = Mutex::new(Some(Cached {
            host: "api.test".into(),
            port: good.port(),
            addrs: vec![refusing()],
            at: Instant::now() - ADDRESS_TTL - Duration::from_secs(1),
        }));
        dial(
            &resolver,
            &cache,
            "api.test",
            good.port(),
            PER_ADDRESS_TIMEOUT,
        )
        .unwrap();
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "a stale answer is not used"
        );
        dial(
            &resolver,
            &cache,
            "other.test",
            good.port(),
            PER_ADDRESS_TIMEOUT,
        )
        .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 2, "the cache is per name");
    }

    #[test]
    fn an_ip_literal_is_never_looked_up() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let good = listener.local_addr().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let resolver = counting(vec![], calls.clone());
        let cache = Mutex::new(None);
        dial(
            &resolver,
            &cache,
            "127.0.0.1",
            good.port(),
            PER_ADDRESS_TIMEOUT,
        )
        .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn an_empty_answer_is_an_error_not_a_panic() {
        let resolver: Resolver = Arc::new(|_, _| Ok(Vec::new()));
        let cache = Mutex::new(None);
        let e = dial(&resolver, &cache, "api.test", 1, PER_ADDRESS_TIMEOUT).unwrap_err();
        assert!(e.contains("no address"), "{e}");
    }
}
