//! Test harness for the kubelet API: a test PKI, the server on a real reactor in its own thread
//! (the harness plays the daemon: it routes events and answers authorisation requests from a
//! fixed table, as the API server's TokenReview / SubjectAccessReview would), and a TLS client.
//!
//! Until the fake cocoon implements `vm exec` / `vm logs`, a small perl stand-in plays cocoon: it
//! runs the exec command locally (a "guest" on the host) and serves logs from files with `tail`.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use vk_cocoon::kubelet::server::ServedMetrics;
use vk_cocoon::kubelet::tls::{TlsSettings, TlsState};
use vk_cocoon::kubelet::{
    AuthAnswer, AuthRequest, KubeletConfig, KubeletServer, KubeletView, PodInfo, PodVm, UserInfo,
};
use vk_cocoon::metrics::probes::ProbeCounts;
use vk_cocoon::metrics::stats::{StatsHub, StatsPaths};
use vk_cocoon::metrics::Metrics;
use vk_cocoon::reactor::{Event, Reactor};

pub struct Pki {
    pub ca_pem: String,
    pub ca_der: CertificateDer<'static>,
    ca_params: CertificateParams,
    ca_key: KeyPair,
}

pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

impl Pki {
    pub fn new(name: &str) -> Pki {
        let ca_key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        p.distinguished_name = dn;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = p.clone().self_signed(&ca_key).unwrap();
        Pki {
            ca_pem: ca.pem(),
            ca_der: ca.der().clone(),
            ca_params: p,
            ca_key,
        }
    }

    pub fn issue(&self, cn: &str, orgs: &[&str], server: bool) -> Issued {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, cn);
        for o in orgs {
            dn.push(DnType::OrganizationName, *o);
        }
        p.distinguished_name = dn;
        if server {
            p.subject_alt_names = vec![SanType::DnsName("localhost".try_into().unwrap())];
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        } else {
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        }
        let issuer = self.ca_params.clone().self_signed(&self.ca_key).unwrap();
        let cert = p.signed_by(&key, &issuer, &self.ca_key).unwrap();
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert: cert.der().clone(),
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        }
    }
}

/// The stand-in for `cocoon`: `vm exec [-i] -- ID -- ARGV` runs ARGV; `vm logs [--tail N] [-f]
/// -- ID` prints `<logdir>/<ID>.log` (through tail). The log dir comes first in @ARGV.
const STAND_IN: &str = r#"
my $dir = shift @ARGV; my $grp = shift @ARGV; my $verb = shift @ARGV;
if ($verb eq 'exec') {
  while (@ARGV) { last if shift(@ARGV) eq '--'; }
  shift @ARGV;
  shift @ARGV if @ARGV && $ARGV[0] eq '--';
  exec { $ARGV[0] } @ARGV or do { print STDERR "Error: exec: $!\n"; exit 1 };
}
if ($verb eq 'logs') {
  my ($tail, $follow) = (undef, 0);
  while (@ARGV > 1) { my $a = shift @ARGV; if ($a eq '--tail') { $tail = shift @ARGV } elsif ($a eq '-f') { $follow = 1 } }
  my $f = "$dir/$ARGV[0].log";
  if (! -e $f) { print STDERR "Error: open log $f: VM may not have been started yet\n"; exit 1 }
  my @cmd = ('tail', '-n', defined $tail ? $tail : '+1');
  push @cmd, '-f' if $follow;
  exec { 'tail' } @cmd, $f;
}
print STDERR "Error: unknown command\n"; exit 1;
"#;

pub fn stand_in_cocoon(log_dir: &Path) -> Vec<String> {
    vec![
        "perl".into(),
        "-e".into(),
        STAND_IN.into(),
        log_dir.display().to_string(),
    ]
}

/// Counters the server thread publishes after every turn.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters {
    pub connections: usize,
    pub children: usize,
    /// Port-forward sockets to guests.
    pub guests: usize,
    pub reactor_children: usize,
    pub turns: u64,
    /// Reviews the server gave up on because their client left (cumulative).
    pub cancelled_reviews: usize,
    /// Reviews of `held-token`, never answered, still waiting.
    pub held_reviews: usize,
}

pub struct Harness {
    pub addr: SocketAddr,
    pub pki: Pki,
    pub stats: StatsHub,
    /// The registry `/metrics` serves and the counts `/metrics/probes` serves.
    pub metrics: Metrics,
    pub probe_counts: ProbeCounts,
    pub counters: Arc<Mutex<Counters>>,
    pub log_dir: PathBuf,
    stop: Arc<AtomicBool>,
    waker: Option<vk_cocoon::reactor::Notifier<()>>,
    thread: Option<JoinHandle<()>>,
    _tmp: tempfile::TempDir,
}

/// Decides like an API server with RBAC: tokens and certificate users from a fixed table.
pub fn decide(req: &AuthRequest) -> AuthAnswer {
    let user = match (&req.user, req.token.as_deref()) {
        (Some(u), _) => u.clone(),
        (None, Some("admin-token")) => UserInfo {
            name: "admin".into(),
            uid: "1".into(),
            groups: vec!["system:masters".into()],
            ..Default::default()
        },
        (None, Some("stats-token")) => UserInfo {
            name: "metrics-server".into(),
            uid: "2".into(),
            groups: vec![],
            ..Default::default()
        },
        (None, Some("broken-token")) => {
            return AuthAnswer::Error("tokenreviews: connection refused".into())
        }
        _ => return AuthAnswer::Unauthenticated,
    };
    let allowed = user.groups.iter().any(|g| g == "system:masters")
        || (user.name == "metrics-server"
            && ["stats", "metrics"].contains(&req.attributes.subresource.as_str())
            && req.attributes.verb == "get");
    AuthAnswer::Decided { user, allowed }
}

pub struct Options {
    pub auth: bool,
    pub pods: Vec<PodInfo>,
    pub tweak: fn(&mut KubeletConfig),
}

impl Default for Options {
    fn default() -> Self {
        Options {
            auth: true,
            pods: Vec::new(),
            tweak: |_| {},
        }
    }
}

/// A `sleep 60` process standing in for a VM's hypervisor: a real /proc entry for the stats
/// and metrics paths to read; killed and reaped when dropped.
pub struct Sleeper(std::process::Child);

impl Sleeper {
    /// Returns once the process sleeps with the same RSS twice in a row: right after exec the
    /// loader is still faulting pages in, and a test comparing a scrape with /proc would race it.
    pub fn start() -> Sleeper {
        let sleeper = Sleeper(
            std::process::Command::new("sleep")
                .arg("60")
                .stdin(std::process::Stdio::null())
                .spawn()
                .expect("spawn sleep"),
        );
        let stat = format!("/proc/{}/stat", sleeper.pid());
        // State and RSS: fields 3 and 24, counted after the `)` closing the command name.
        let read = || {
            let text = std::fs::read_to_string(&stat).ok()?;
            let fields: Vec<String> = text[text.rfind(')')? + 2..]
                .split(' ')
                .map(str::to_string)
                .collect();
            Some((fields.first()?.clone(), fields.get(21)?.clone()))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut last = read();
        while std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            let now = read();
            if now.as_ref().is_some_and(|(state, _)| state == "S") && now == last {
                break;
            }
            last = now;
        }
        sleeper
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn pod(ns: &str, name: &str, vm: Option<(&str, u32)>) -> PodInfo {
    PodInfo {
        namespace: ns.into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        vm: vm.map(|(id, pid)| PodVm {
            id: id.into(),
            name: format!("vk-{ns}-{name}"),
            pid,
            tap: Some("lo".into()),
            backend: "cloud-hypervisor".into(),
            disk: String::new(),
        }),
        pod: Arc::new(
            serde_json::from_value(serde_json::json!({"apiVersion":"v1","kind":"Pod","metadata":{"namespace":ns,"name":name,"uid":format!("uid-{name}")}}))
                .unwrap(),
        ),
        status: None,
    }
}

impl Harness {
    pub fn start(opts: Options) -> Harness {
        let tmp = tempfile::tempdir().unwrap();
        let pki = Pki::new("test-cluster-ca");
        let serving = pki.issue("node-1", &[], true);
        std::fs::write(tmp.path().join("tls.crt"), &serving.cert_pem).unwrap();
        std::fs::write(tmp.path().join("tls.key"), &serving.key_pem).unwrap();
        let log_dir = tmp.path().join("logs");
        std::fs::create_dir_all(&log_dir).unwrap();
        std::fs::create_dir_all(tmp.path().join("cocoon")).unwrap();
        let settings = TlsSettings {
            cert_path: tmp.path().join("tls.crt"),
            key_path: tmp.path().join("tls.key"),
            node_name: "node-1".into(),
            node_ip: None,
            client_ca_pem: Some(pki.ca_pem.clone().into_bytes()),
        };
        let stats = StatsHub::new(StatsPaths {
            proc_root: "/proc".into(),
            cgroup_root: tmp.path().join("cgroup"),
            cgroup_parent: "cocoon.slice".into(),
            cocoon_root: tmp.path().join("cocoon"),
        })
        .background_refresh();
        let mut cfg = KubeletConfig::new("node-1", "cocoon");
        cfg.cocoon = stand_in_cocoon(&log_dir);
        cfg.auth_enabled = opts.auth;
        (opts.tweak)(&mut cfg);
        let counters = Arc::new(Mutex::new(Counters::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let hub = stats.clone();
        let c2 = counters.clone();
        let stop2 = stop.clone();
        let pods = opts.pods;
        let metrics = Metrics::new().unwrap();
        let probe_counts = ProbeCounts::default();
        let served = ServedMetrics {
            metrics: metrics.clone(),
            probes: probe_counts.clone(),
        };
        let thread = std::thread::spawn(move || {
            let mut reactor: Reactor<()> = Reactor::new(1, 16).unwrap();
            let tls = TlsState::new(settings).unwrap();
            let mut server = KubeletServer::new(cfg, tls, hub);
            server.set_view(KubeletView { pods });
            server.serve_metrics(served);
            let addr = server
                .listen(&mut reactor, "127.0.0.1:0".parse().unwrap())
                .unwrap();
            tx.send((addr, reactor.notifier())).unwrap();
            let mut events = Vec::new();
            let mut turns = 0u64;
            // Reviews of `held-token` stay unanswered: a slow API server.
            let mut held = std::collections::HashSet::new();
            let mut cancelled_reviews = 0usize;
            while !stop2.load(Ordering::SeqCst) {
                events.clear();
                reactor.poll(&mut events).unwrap();
                for ev in events.drain(..) {
                    match ev {
                        Event::Io(io) if server.owns_token(io.token) => {
                            server.on_io(&mut reactor, io)
                        }
                        Event::Timer { id, .. } => server.on_timer(&mut reactor, id),
                        Event::ChildOutput { id, stream, data } => {
                            server.on_child_output(&mut reactor, id, stream, &data)
                        }
                        Event::ChildExit(x) => server.on_child_exit(&mut reactor, &x),
                        _ => {}
                    }
                    loop {
                        let reqs = server.take_auth_requests();
                        if reqs.is_empty() {
                            break;
                        }
                        for (id, req, _) in reqs {
                            if req.token.as_deref() == Some("held-token") {
                                held.insert(id);
                                continue;
                            }
                            server.on_auth_answer(&mut reactor, id, decide(&req));
                        }
                    }
                    for id in server.take_cancelled_auth() {
                        held.remove(&id);
                        cancelled_reviews += 1;
                    }
                }
                turns += 1;
                *c2.lock().unwrap() = Counters {
                    connections: server.connection_count(),
                    children: server.child_count(),
                    guests: server.guest_connection_count(),
                    reactor_children: reactor.children_running(),
                    turns,
                    cancelled_reviews,
                    held_reviews: held.len(),
                };
            }
        });
        let (addr, notifier) = rx.recv().unwrap();
        Harness {
            addr,
            pki,
            stats,
            metrics,
            probe_counts,
            counters,
            log_dir,
            stop,
            waker: Some(notifier),
            thread: Some(thread),
            _tmp: tmp,
        }
    }

    pub fn counters(&self) -> Counters {
        *self.counters.lock().unwrap()
    }

    /// Waits (bounded) until the server has no connection and no child left.
    pub fn wait_idle(&self) -> Counters {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let c = self.counters();
            if (c.connections == 0 && c.children == 0 && c.guests == 0 && c.reactor_children == 0)
                || std::time::Instant::now() > deadline
            {
                return c;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn client_config(
        &self,
        client: Option<&Issued>,
        roots_pem: &str,
    ) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(roots_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let b = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        Arc::new(match client {
            Some(i) => b
                .with_client_auth_cert(vec![i.cert.clone()], i.key.clone_key())
                .unwrap(),
            None => b.with_no_client_auth(),
        })
    }

    /// A connected TLS stream (handshake completed or failed).
    pub fn connect(
        &self,
        cfg: Arc<rustls::ClientConfig>,
    ) -> std::io::Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>> {
        let sock = TcpStream::connect(self.addr)?;
        sock.set_read_timeout(Some(Duration::from_secs(10)))?;
        let conn =
            rustls::ClientConnection::new(cfg, ServerName::try_from("localhost").unwrap()).unwrap();
        let mut s = rustls::StreamOwned::new(conn, sock);
        while s.conn.is_handshaking() {
            s.conn.complete_io(&mut s.sock)?;
        }
        // With TLS 1.3 a refused client certificate only shows on the first read; flush a no-op.
        s.flush()?;
        Ok(s)
    }

    /// One request over a fresh connection with `Connection: close`; reads to EOF.
    pub fn request(
        &self,
        cfg: Arc<rustls::ClientConfig>,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> std::io::Result<Response> {
        let mut s = self.connect(cfg)?;
        let mut req =
            format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes())?;
        let mut raw = Vec::new();
        match s.read_to_end(&mut raw) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
            Err(e) => return Err(e),
        }
        Response::parse(&raw).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("bad response: {:?}", String::from_utf8_lossy(&raw)),
            )
        })
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(w) = self.waker.take() {
            w.post(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn parse(raw: &[u8]) -> Option<Response> {
        let mut hs = [httparse::EMPTY_HEADER; 64];
        let mut r = httparse::Response::new(&mut hs);
        let n = match r.parse(raw).ok()? {
            httparse::Status::Complete(n) => n,
            httparse::Status::Partial => return None,
        };
        let headers: Vec<(String, String)> = r
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.to_ascii_lowercase(),
                    String::from_utf8_lossy(h.value).into_owned(),
                )
            })
            .collect();
        let status = r.code?;
        let mut body = raw[n..].to_vec();
        if headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"))
        {
            body = dechunk(&body)?;
        }
        Some(Response {
            status,
            headers,
            body,
        })
    }
    pub fn header(&self, k: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Decodes a complete chunked body (the test reads to EOF first).
pub fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = b.windows(2).position(|w| w == b"\r\n")?;
        let size =
            usize::from_str_radix(std::str::from_utf8(&b[..line_end]).ok()?.trim(), 16).ok()?;
        b = &b[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

/// `promtool check metrics` on a Prometheus text (skipped when promtool is not installed).
pub fn promtool_check(text: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let Ok(mut child) = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    else {
        eprintln!("SKIP promtool check: promtool not installed (Debian package `prometheus`)");
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool rejected:\n{}\n{}\n--- text ---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
