//! No caller can exhaust the daemon: each flood (anonymous and authenticated pipelining, idle
//! sockets from one or many addresses, exec stdin to a command that does not read over SPDY
//! and WebSocket, WebSocket pings with the pongs never read, exec output never read) runs
//! while a legitimate client's kubelet calls and /metrics scrapes keep answering within
//! 100 ms and the server's RSS stays under 64 MiB.
//!
//! The server under test runs in a process of its own: this test binary re-run with only
//! `flood_server_process` (the kubelet API and the /metrics listener on one reactor, as the
//! daemon wires them), so its RSS is the server's alone; the attackers and the probing client
//! live here. Attackers connect from 127.0.0.2 and up, the legitimate client from 127.0.0.1:
//! all traffic stays on loopback.
//!
//! Out of scope here: connection-rate floods. An attacker that reconnects as fast as it can
//! makes the server do a TLS handshake per connection (CPU) and can overflow the kernel's
//! accept queue (legitimate SYNs then wait for a 1 s retransmit); the attackers here re-open
//! what the server closed every 100 ms (idle sockets: every 500 ms), which keeps the tests
//! about memory and connection slots.
//!
//! The default tests flood for `FLOOD` (5 s, CI time); `bench_floods` (ignored) runs each for
//! `VK_FLOOD_SECS` (default 30) and prints RSS and latency figures beside a no-flood baseline:
//! `cargo test --test contract kubelet_floods::bench_floods -- --ignored --nocapture`.

use crate::kubelet_support;
use crate::load_support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kubelet_support::{decide, pod, stand_in_cocoon, Issued, Pki};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConnection, StreamOwned};
use vk_cocoon::config::ListenAddr;
use vk_cocoon::kubelet::tls::{TlsSettings, TlsState};
use vk_cocoon::kubelet::{KubeletConfig, KubeletServer, KubeletView};
use vk_cocoon::metrics::http::MetricsServer;
use vk_cocoon::metrics::stats::{StatsHub, StatsPaths};
use vk_cocoon::metrics::Metrics;
use vk_cocoon::reactor::{Event, Reactor};

/// How long each flood of the default tests lasts.
const FLOOD: Duration = Duration::from_secs(5);
const RSS_LIMIT: u64 = 64 << 20;
const LATENCY_LIMIT: Duration = Duration::from_millis(100);
/// A legitimate answer slower than this is a stalled server, not a busy host.
const STALL: Duration = Duration::from_secs(3);
/// Pause between two probes of the legitimate client.
const PROBE_EVERY: Duration = Duration::from_millis(25);
/// How often an attacker re-opens what the server closed.
const RECONNECT_EVERY: Duration = Duration::from_millis(100);
/// How often the idle-socket attacker re-opens the sockets the server closed.
const IDLE_ROUND: Duration = Duration::from_millis(500);

type Tls = StreamOwned<ClientConnection, TcpStream>;

/// One flood at a time: they would otherwise compete for the machine's cores and blur
/// each other's latency.
static SERIAL: Mutex<()> = Mutex::new(());

// ----- the server process -----------------------------------------------------------------

/// The server half: serves until its stdin closes. Does nothing unless started by a test.
#[test]
#[ignore = "the server process of the flood tests; they start it themselves"]
fn flood_server_process() {
    let Ok(dir) = std::env::var("VK_FLOOD_DIR") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let settings = TlsSettings {
        cert_path: dir.join("tls.crt"),
        key_path: dir.join("tls.key"),
        node_name: "node-1".into(),
        node_ip: None,
        client_ca_pem: Some(std::fs::read(dir.join("ca.pem")).unwrap()),
    };
    let stats = StatsHub::new(StatsPaths {
        proc_root: "/proc".into(),
        cgroup_root: dir.join("cgroup"),
        cgroup_parent: "cocoon.slice".into(),
        cocoon_root: dir.join("cocoon"),
    });
    let mut cfg = KubeletConfig::new("node-1", "cocoon");
    cfg.cocoon = stand_in_cocoon(&dir.join("logs"));
    let mut reactor: Reactor<()> = Reactor::new(1, 16).unwrap();
    let mut kubelet = KubeletServer::new(cfg, TlsState::new(settings).unwrap(), stats);
    kubelet.set_view(KubeletView {
        pods: vec![pod("ns1", "web", Some(("vm-web", 0)))],
    });
    let kubelet_addr = kubelet
        .listen(&mut reactor, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    let listen = ListenAddr::parse("127.0.0.1:0").unwrap();
    let mut metrics = MetricsServer::bind(&listen, Metrics::new().unwrap(), &mut reactor).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (stop2, notifier) = (stop.clone(), reactor.notifier());
    std::thread::spawn(move || {
        // The parent closes our stdin (or dies): stop.
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        stop2.store(true, Ordering::SeqCst);
        notifier.post(());
    });
    println!(
        "FLOOD-SERVER {kubelet_addr} {} {}",
        metrics.local_addr(),
        std::process::id()
    );
    let mut events = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        events.clear();
        reactor.poll(&mut events).unwrap();
        for ev in events.drain(..) {
            match ev {
                Event::Io(io) if kubelet.owns_token(io.token) => kubelet.on_io(&mut reactor, io),
                Event::Io(io) => {
                    metrics.handle_io(&mut reactor, &io);
                }
                Event::Timer { id, .. } if kubelet.owns_timer(id) => {
                    kubelet.on_timer(&mut reactor, id)
                }
                Event::Timer { id, .. } => {
                    metrics.handle_timer(&mut reactor, id);
                }
                Event::ChildOutput { id, stream, data } => {
                    kubelet.on_child_output(&mut reactor, id, stream, &data)
                }
                Event::ChildExit(x) => kubelet.on_child_exit(&mut reactor, &x),
                _ => {}
            }
            loop {
                let reqs = kubelet.take_auth_requests();
                if reqs.is_empty() {
                    break;
                }
                for (id, req, _) in reqs {
                    kubelet.on_auth_answer(&mut reactor, id, decide(&req));
                }
            }
        }
    }
}

struct Server {
    child: Child,
    pid: u32,
    kubelet: SocketAddr,
    metrics: SocketAddr,
    ca_pem: String,
    admin: Issued,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::new("flood-ca");
        let serving = pki.issue("node-1", &[], true);
        std::fs::write(dir.path().join("tls.crt"), &serving.cert_pem).unwrap();
        std::fs::write(dir.path().join("tls.key"), &serving.key_pem).unwrap();
        std::fs::write(dir.path().join("ca.pem"), &pki.ca_pem).unwrap();
        for d in ["logs", "cocoon", "cgroup"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "kubelet_floods::flood_server_process",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("VK_FLOOD_DIR", dir.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest prints "test kubelet_floods::flood_server_process ... " before the
                // test's output.
                if let Some((_, rest)) = line.split_once("FLOOD-SERVER ") {
                    let _ = tx.send(rest.to_string());
                }
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the server process reports its addresses");
        let mut parts = line.split(' ');
        let kubelet = parts.next().unwrap().parse().unwrap();
        let metrics = parts.next().unwrap().parse().unwrap();
        let pid = parts.next().unwrap().parse().unwrap();
        Server {
            child,
            pid,
            kubelet,
            metrics,
            ca_pem: pki.ca_pem.clone(),
            admin: pki.issue("admin", &["system:masters"], false),
            _dir: dir,
        }
    }

    /// Resident set of the server process, in bytes.
    fn rss(&self) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }

    fn tls_config(&self, cert: bool) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let b = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        Arc::new(if cert {
            b.with_client_auth_cert(vec![self.admin.cert.clone()], self.admin.key.clone_key())
                .unwrap()
        } else {
            b.with_no_client_auth()
        })
    }

    /// The `n`th scrape of this server's `/metrics` text, for counters.
    fn metrics_text(&self) -> String {
        scrape(self.metrics)
            .map(|(_, body)| body)
            .unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Closing stdin stops the loop; kill (our own child, by its handle) if it lingers.
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ----- clients ----------------------------------------------------------------------------

/// A TCP connection to `to` from the loopback address `from`.
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.bind(&SocketAddrV4::new(from, 0).into())?;
    s.connect_timeout(&to.into(), Duration::from_secs(2))?;
    Ok(s.into())
}

fn tls_connect(sock: TcpStream, cfg: Arc<rustls::ClientConfig>) -> std::io::Result<Tls> {
    let conn = ClientConnection::new(cfg, ServerName::try_from("localhost").unwrap())
        .map_err(std::io::Error::other)?;
    let mut s = StreamOwned::new(conn, sock);
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock)?;
    }
    Ok(s)
}

/// A legitimate kubelet call on a fresh connection: GET /pods with the admin certificate.
fn kubelet_call(server: &Server, cfg: &Arc<rustls::ClientConfig>) -> Result<Duration, String> {
    let t = Instant::now();
    let sock = TcpStream::connect(server.kubelet).map_err(|e| format!("connect: {e}"))?;
    sock.set_read_timeout(Some(Duration::from_secs(2))).ok();
    sock.set_write_timeout(Some(Duration::from_secs(2))).ok();
    let mut s = tls_connect(sock, cfg.clone()).map_err(|e| format!("handshake: {e}"))?;
    s.write_all(b"GET /pods HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    match s.read_to_end(&mut raw) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(format!("read: {e}")),
    }
    if !raw.starts_with(b"HTTP/1.1 200 ") || !raw.ends_with(b"}") {
        return Err(format!(
            "answer: {:?}",
            String::from_utf8_lossy(&raw[..raw.len().min(80)])
        ));
    }
    Ok(t.elapsed())
}

/// A Prometheus scrape on a fresh connection; the body with the time it took.
fn scrape(addr: SocketAddr) -> Result<(Duration, String), String> {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| format!("read: {e}"))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    if !text.starts_with("HTTP/1.1 200 ") {
        return Err(format!("answer: {:?}", &text[..text.len().min(80)]));
    }
    Ok((t.elapsed(), text))
}

/// A masked client WebSocket frame.
fn ws_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mask = [0x11u8, 0x22, 0x33, 0x44];
    let mut f = vec![0x80 | opcode];
    match payload.len() {
        n if n < 126 => f.push(0x80 | n as u8),
        n if n <= 0xffff => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(0x80 | 127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// Sends an upgrade request and reads the response head; Err unless it is a 101.
fn upgrade(s: &mut Tls, request: &str) -> std::io::Result<()> {
    s.write_all(request.as_bytes())?;
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 4096 {
        if s.read(&mut b)? == 0 {
            break;
        }
        head.push(b[0]);
    }
    if head.starts_with(b"HTTP/1.1 101") {
        Ok(())
    } else {
        Err(std::io::Error::other(
            String::from_utf8_lossy(&head).into_owned(),
        ))
    }
}

/// An exec session over WebSocket (admin certificate) from the attacker's address.
fn ws_session(
    kubelet: SocketAddr,
    admin: Arc<rustls::ClientConfig>,
    query: &str,
) -> std::io::Result<Tls> {
    let sock = connect_from(ATTACKER, kubelet)?;
    sock.set_write_timeout(Some(Duration::from_millis(200)))?;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut s = tls_connect(sock, admin)?;
    upgrade(
        &mut s,
        &format!(
            "GET /exec/ns1/web/agent?{query} HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: v4.channel.k8s.io\r\n\r\n"
        ),
    )?;
    Ok(s)
}

/// An exec session over SPDY (admin certificate) from the attacker's address, its streams
/// created.
fn spdy_session(
    kubelet: SocketAddr,
    admin: Arc<rustls::ClientConfig>,
    query: &str,
) -> std::io::Result<Tls> {
    use flate2::{Compress, Compression, FlushCompress};
    let sock = connect_from(ATTACKER, kubelet)?;
    sock.set_write_timeout(Some(Duration::from_millis(200)))?;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut s = tls_connect(sock, admin)?;
    upgrade(
        &mut s,
        &format!(
            "POST /exec/ns1/web/agent?{query} HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\nContent-Length: 0\r\n\r\n"
        ),
    )?;
    let mut z = Compress::new(Compression::default(), true);
    z.set_dictionary(&vk_cocoon::kubelet::exec::spdy::dictionary())
        .map_err(std::io::Error::other)?;
    for (id, kind) in [(1u32, "error"), (3, "stdin"), (5, "stdout"), (7, "stderr")] {
        let mut block = 1u32.to_be_bytes().to_vec();
        for v in ["streamtype", kind] {
            block.extend_from_slice(&(v.len() as u32).to_be_bytes());
            block.extend_from_slice(v.as_bytes());
        }
        let mut packed = Vec::with_capacity(4096);
        z.compress_vec(&block, &mut packed, FlushCompress::Sync)
            .map_err(std::io::Error::other)?;
        let mut p = id.to_be_bytes().to_vec();
        p.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        p.extend_from_slice(&packed);
        let mut f = vec![0x80, 3, 0, 1, 0];
        f.extend_from_slice(&(p.len() as u32).to_be_bytes()[1..]);
        f.extend_from_slice(&p);
        s.write_all(&f)?;
    }
    Ok(s)
}

// ----- floods -----------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flood {
    None,
    /// Anonymous TLS clients pipelining requests and reading nothing, and an authenticated one
    /// pipelining /pods.
    Pipelining,
    /// 1,030 idle TCP connections to the kubelet port and 300 to /metrics from one address.
    IdleOneAddress,
    /// The same spread over 40 addresses (below every per-address limit).
    IdleManyAddresses,
    /// stdin streamed to `sleep` (which never reads it) over SPDY, output never read.
    ExecStdinSpdy,
    /// The same over WebSocket.
    ExecStdinWebSocket,
    /// WebSocket pings, the pongs never read.
    WebSocketPings,
    /// `yes` to exec sessions whose output is never read.
    ExecOutputUnread,
}

const ALL: [Flood; 7] = [
    Flood::Pipelining,
    Flood::IdleOneAddress,
    Flood::IdleManyAddresses,
    Flood::ExecStdinSpdy,
    Flood::ExecStdinWebSocket,
    Flood::WebSocketPings,
    Flood::ExecOutputUnread,
];

const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// Attacker threads; they stop when dropped.
struct Attack {
    stop: Arc<AtomicBool>,
    /// Bytes the attackers got written (or connections they opened, for idle floods).
    work: Arc<AtomicU64>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Attack {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Hands `data` to TLS and pushes records to the socket, never reading: rustls' own
/// `Stream::write` reads whatever the server sent, which would drain what the attack is
/// about. Returns the plaintext bytes taken.
fn send_unread(s: &mut Tls, data: &[u8]) -> std::io::Result<usize> {
    let n = s.conn.writer().write(data)?;
    while s.conn.wants_write() {
        s.conn.write_tls(&mut s.sock)?;
    }
    Ok(n)
}

/// Writes `chunk` every `pace` (or back to back) until `stop`; reconnects with `open` when
/// the server closes, at most every `RECONNECT_EVERY` (a reconnect storm is a handshake
/// flood, another attack: see the module documentation).
fn blast(
    stop: Arc<AtomicBool>,
    work: Arc<AtomicU64>,
    open: impl Fn() -> std::io::Result<Tls>,
    chunk: Vec<u8>,
    pace: Duration,
) {
    let mut conn: Option<Tls> = None;
    while !stop.load(Ordering::Relaxed) {
        let Some(s) = conn.as_mut() else {
            conn = open().ok();
            std::thread::sleep(RECONNECT_EVERY);
            continue;
        };
        match send_unread(s, &chunk) {
            Ok(n) => {
                work.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => conn = None,
        }
        if !pace.is_zero() {
            std::thread::sleep(pace);
        }
    }
}

/// Holds `n` idle connections to `to` spread over `addresses` source addresses, re-opening
/// those the server closes, until `stop`.
fn hold_idle(stop: Arc<AtomicBool>, work: Arc<AtomicU64>, to: SocketAddr, n: usize, addresses: u8) {
    let mut conns: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    while !stop.load(Ordering::Relaxed) {
        for (i, slot) in conns.iter_mut().enumerate() {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let alive = slot.as_mut().is_some_and(|s| {
                let mut b = [0u8; 512];
                match s.read(&mut b) {
                    Ok(0) => false,
                    Ok(_) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                }
            });
            if !alive {
                let from = Ipv4Addr::new(127, 0, 0, 2 + (i % usize::from(addresses)) as u8);
                *slot = connect_from(from, to).ok().inspect(|s| {
                    let _ = s.set_nonblocking(true);
                });
                work.fetch_add(1, Ordering::Relaxed);
            }
        }
        std::thread::sleep(IDLE_ROUND);
    }
}

fn start_attack(server: &Server, flood: Flood) -> Attack {
    let stop = Arc::new(AtomicBool::new(false));
    let work = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    let mut spawn = |f: Box<dyn FnOnce(Arc<AtomicBool>, Arc<AtomicU64>) + Send>| {
        let (stop, work) = (stop.clone(), work.clone());
        threads.push(std::thread::spawn(move || f(stop, work)));
    };
    let kubelet = server.kubelet;
    let metrics = server.metrics;
    let anon = server.tls_config(false);
    let admin = server.tls_config(true);
    match flood {
        Flood::None => {}
        Flood::Pipelining => {
            // Four anonymous clients, two with the admin certificate pipelining /pods.
            for i in 0..6 {
                let cfg = if i < 4 { anon.clone() } else { admin.clone() };
                let path = if i < 4 { "/" } else { "/pods" };
                let chunk = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").repeat(1000);
                spawn(Box::new(move |stop, work| {
                    let open = move || {
                        let sock = connect_from(ATTACKER, kubelet)?;
                        sock.set_write_timeout(Some(Duration::from_millis(200)))?;
                        tls_connect(sock, cfg.clone())
                    };
                    // The issue's rhythm: a thousand requests every 15 ms, nothing read.
                    blast(
                        stop,
                        work,
                        open,
                        chunk.into_bytes(),
                        Duration::from_millis(15),
                    )
                }));
            }
        }
        Flood::IdleOneAddress | Flood::IdleManyAddresses => {
            let addresses = if flood == Flood::IdleOneAddress {
                1
            } else {
                40
            };
            spawn(Box::new(move |stop, work| {
                hold_idle(stop, work, kubelet, 1030, addresses)
            }));
            spawn(Box::new(move |stop, work| {
                hold_idle(stop, work, metrics, 300, addresses)
            }));
        }
        Flood::ExecStdinSpdy
        | Flood::ExecStdinWebSocket
        | Flood::WebSocketPings
        | Flood::ExecOutputUnread => {
            for _ in 0..4 {
                let server_kubelet = ServerRef {
                    kubelet,
                    admin: admin.clone(),
                };
                spawn(Box::new(move |stop, work| {
                    let (open, chunk): (Box<dyn Fn() -> std::io::Result<Tls>>, Vec<u8>) =
                        match flood {
                            Flood::ExecStdinSpdy => {
                                let mut frame = 3u32.to_be_bytes().to_vec();
                                frame.push(0);
                                frame.extend_from_slice(&(32_768u32).to_be_bytes()[1..]);
                                frame.extend_from_slice(&[b'x'; 32_768]);
                                (
                                    Box::new(move || {
                                        server_kubelet.spdy(
                                            "command=sleep&command=600&input=1&output=1&error=1",
                                        )
                                    }),
                                    frame,
                                )
                            }
                            Flood::ExecStdinWebSocket => {
                                let mut payload = vec![0u8];
                                payload.extend_from_slice(&[b'x'; 32_768]);
                                (
                                    Box::new(move || {
                                        server_kubelet
                                            .ws("command=sleep&command=600&input=1&output=1")
                                    }),
                                    ws_frame(2, &payload),
                                )
                            }
                            Flood::WebSocketPings => (
                                Box::new(move || {
                                    server_kubelet.ws("command=sleep&command=600&output=1")
                                }),
                                ws_frame(9, &[b'p'; 125]).repeat(256),
                            ),
                            _ => (
                                Box::new(move || server_kubelet.ws("command=yes&output=1")),
                                Vec::new(),
                            ),
                        };
                    if chunk.is_empty() {
                        // Open sessions and read nothing from them.
                        let mut held = Vec::new();
                        while !stop.load(Ordering::Relaxed) {
                            if held.len() < 4 {
                                if let Ok(s) = open() {
                                    held.push(s);
                                    work.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    } else {
                        blast(stop, work, open, chunk, Duration::ZERO)
                    }
                }));
            }
        }
    }
    Attack {
        stop,
        work,
        threads,
    }
}

/// What the exec attackers need of the server, to move into their threads.
struct ServerRef {
    kubelet: SocketAddr,
    admin: Arc<rustls::ClientConfig>,
}

impl ServerRef {
    fn ws(&self, query: &str) -> std::io::Result<Tls> {
        ws_session(self.kubelet, self.admin.clone(), query)
    }
    fn spdy(&self, query: &str) -> std::io::Result<Tls> {
        spdy_session(self.kubelet, self.admin.clone(), query)
    }
}

// ----- measuring --------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Figures {
    kubelet: Vec<Duration>,
    scrapes: Vec<Duration>,
    failures: Vec<String>,
    max_rss: u64,
    attack_work: u64,
}

fn percentile(v: &[Duration], p: f64) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

impl Figures {
    fn line(&self, name: &str) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        format!(
            "{name:<22} rss max {:>6.1} MiB | kubelet p50 {:>6.2} ms p99 {:>6.2} ms max {:>6.2} ms (n={}) | scrape p50 {:>6.2} ms p99 {:>6.2} ms max {:>6.2} ms (n={}) | failures {}",
            self.max_rss as f64 / (1 << 20) as f64,
            ms(percentile(&self.kubelet, 0.5)),
            ms(percentile(&self.kubelet, 0.99)),
            ms(percentile(&self.kubelet, 1.0)),
            self.kubelet.len(),
            ms(percentile(&self.scrapes, 0.5)),
            ms(percentile(&self.scrapes, 0.99)),
            ms(percentile(&self.scrapes, 1.0)),
            self.scrapes.len(),
            self.failures.len(),
        )
    }
}

/// Runs `flood` against a fresh server for `how_long` while probing as a legitimate client.
fn run(flood: Flood, how_long: Duration) -> (Figures, String) {
    let server = Server::start();
    let cfg = server.tls_config(true);
    // The server is up and answering before the attack starts.
    kubelet_call(&server, &cfg).expect("a first legitimate call");
    let attack = start_attack(&server, flood);
    let mut f = Figures::default();
    let start = Instant::now();
    // Give the attackers a head start so probes meet the flood, not its build-up.
    while start.elapsed() < how_long / 5 {
        f.max_rss = f.max_rss.max(server.rss());
        std::thread::sleep(PROBE_EVERY);
    }
    while start.elapsed() < how_long {
        match kubelet_call(&server, &cfg) {
            Ok(d) => f.kubelet.push(d),
            Err(e) => f.failures.push(format!("kubelet: {e}")),
        }
        match scrape(server.metrics) {
            Ok((d, _)) => f.scrapes.push(d),
            Err(e) => f.failures.push(format!("scrape: {e}")),
        }
        f.max_rss = f.max_rss.max(server.rss());
        std::thread::sleep(PROBE_EVERY);
    }
    f.attack_work = attack.work.load(Ordering::Relaxed);
    drop(attack);
    let metrics = server.metrics_text();
    (f, metrics)
}

fn assert_withstands(flood: Flood) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ((f, metrics), wakeup) = load_support::with_wakeup_probe(|| run(flood, FLOOD));
    eprintln!("{}", f.line(&format!("{flood:?}")));
    assert!(f.attack_work > 0, "{flood:?}: the attack did nothing");
    assert!(
        f.failures.is_empty(),
        "{flood:?}: legitimate calls failed: {:?}",
        &f.failures[..f.failures.len().min(5)]
    );
    assert!(
        f.kubelet.len() >= 10 && f.scrapes.len() >= 10,
        "{flood:?}: too few probes: {f:?}"
    );
    assert!(
        f.max_rss < RSS_LIMIT,
        "{flood:?}: server RSS reached {} MiB",
        f.max_rss >> 20
    );
    // A server the flood stalls answers in seconds, or not at all (the failures above): no
    // load excuses that. p99 within the limit, the single slowest call with slack for a
    // debug build, hold only when the host gives the server a CPU when it wakes (the
    // figures print the maximum; bench_floods reports it beside the baseline).
    let judged = load_support::quiet_host(wakeup);
    for (what, v) in [("kubelet call", &f.kubelet), ("scrape", &f.scrapes)] {
        let (p99, max) = (percentile(v, 0.99), percentile(v, 1.0));
        assert!(max < STALL, "{flood:?}: {what} stalled: slowest {max:?}");
        assert!(
            !judged || (p99 < LATENCY_LIMIT && max < LATENCY_LIMIT * 5),
            "{flood:?}: {what} p99 {p99:?}, slowest {max:?}"
        );
    }
    if matches!(flood, Flood::IdleOneAddress) {
        assert!(
            metrics.contains(
                "vk_cocoon_connections_refused_total{listener=\"kubelet\",reason=\"peer_limit\"}"
            ) && metrics.contains(
                "vk_cocoon_connections_refused_total{listener=\"metrics\",reason=\"peer_limit\"}"
            ),
            "refusals are counted: {}",
            metrics
                .lines()
                .filter(|l| l.contains("refused"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

#[test]
fn anonymous_and_authenticated_pipelining() {
    assert_withstands(Flood::Pipelining);
}

#[test]
fn idle_sockets_from_one_address() {
    assert_withstands(Flood::IdleOneAddress);
}

#[test]
fn idle_sockets_from_many_addresses() {
    assert_withstands(Flood::IdleManyAddresses);
}

#[test]
fn exec_stdin_to_a_command_that_does_not_read_spdy() {
    assert_withstands(Flood::ExecStdinSpdy);
}

#[test]
fn exec_stdin_to_a_command_that_does_not_read_websocket() {
    assert_withstands(Flood::ExecStdinWebSocket);
}

#[test]
fn websocket_pings_whose_pongs_are_never_read() {
    assert_withstands(Flood::WebSocketPings);
}

#[test]
fn exec_output_never_read() {
    assert_withstands(Flood::ExecOutputUnread);
}

/// Figures for every flood beside a no-flood baseline, `VK_FLOOD_SECS` each (default 30).
#[test]
#[ignore = "benchmark: cargo test --test contract kubelet_floods::bench_floods -- --ignored --nocapture"]
fn bench_floods() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let secs = std::env::var("VK_FLOOD_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let how_long = Duration::from_secs(secs);
    println!(
        "each flood {secs} s; server RSS from /proc/<server pid>/status; fresh connection per call"
    );
    for flood in std::iter::once(Flood::None).chain(ALL) {
        let (f, _) = run(flood, how_long);
        println!("{}", f.line(&format!("{flood:?}")));
        for e in f.failures.iter().take(3) {
            println!("    failure: {e}");
        }
    }
}

// ----- deadlines, in process ----------------------------------------------------------------

use kubelet_support::{Harness, Options};

/// Waits (bounded) until the server holds no connection and no child; returns how long it took.
fn until_idle(h: &Harness, within: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < within {
        let c = h.counters();
        if c.connections == 0 && c.reactor_children == 0 {
            return Some(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn a_client_that_reads_nothing_of_its_exec_output_is_closed() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Harness::start(Options {
        pods: vec![pod("ns1", "web", Some(("vm-web", 0)))],
        tweak: |c| c.write_stall_timeout = Duration::from_secs(1),
        ..Default::default()
    });
    let admin = h.pki.issue("admin", &["system:masters"], false);
    let s = ws_session(
        h.addr,
        h.client_config(Some(&admin), &h.pki.ca_pem),
        "command=yes&output=1",
    )
    .unwrap();
    // The command runs (paused once 256 KiB wait) until a second passes with nothing read.
    let t = Instant::now();
    let mut started = false;
    while t.elapsed() < Duration::from_secs(30) && !started {
        started = h.counters().reactor_children == 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(started, "the exec command started");
    let took = until_idle(&h, Duration::from_secs(20)).expect("closed, its command killed");
    assert!(
        took >= Duration::from_millis(900),
        "not before the stall timeout: {took:?}"
    );
    drop(s);
}

#[test]
fn unauthenticated_connections_get_a_short_deadline_and_one_answer() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Harness::start(Options {
        tweak: |c| c.unauthenticated_timeout = Duration::from_secs(1),
        ..Default::default()
    });
    // A socket that never starts its handshake is closed after the short deadline.
    let mut idle = TcpStream::connect(h.addr).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let t = Instant::now();
    let mut b = [0u8; 16];
    let closed = matches!(idle.read(&mut b), Ok(0) | Err(_));
    assert!(
        closed && t.elapsed() < Duration::from_secs(20),
        "{:?}",
        t.elapsed()
    );
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    // An anonymous request on a keep-alive connection gets its 401, then the connection ends.
    let mut s = h.connect(h.client_config(None, &h.pki.ca_pem)).unwrap();
    s.write_all(b"GET /pods HTTP/1.1\r\nHost: x\r\n\r\nGET /pods HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 401 "), "{text}");
    assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "one answer: {text}");
    assert!(until_idle(&h, Duration::from_secs(10)).is_some());
}
