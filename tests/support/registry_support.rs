//! A real OCI registry for tests and benchmarks: Debian's docker-registry (distribution),
//! installed by .ci/run, serving a temporary directory on a loopback port; killed on drop.
#![allow(dead_code)]

use std::fs;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";

pub struct Registry {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
}

impl Registry {
    /// Whether the registry binary is installed (tests that may skip check this first).
    pub fn available() -> bool {
        Path::new(REGISTRY_BIN).exists()
    }

    /// Starts a registry with deletes enabled, its storage in a temp dir under `root` (the
    /// system temp dir when None); `htpasswd` (an `htpasswd -B` file's bytes) turns on basic
    /// auth. Waits until the port accepts connections.
    pub fn start(root: Option<&Path>, htpasswd: Option<&[u8]>) -> Registry {
        Registry::start_with(root, htpasswd, None)
    }

    /// Like [`Registry::start`], serving HTTPS only when `tls` names a PEM certificate chain
    /// and its key.
    pub fn start_with(
        root: Option<&Path>,
        htpasswd: Option<&[u8]>,
        tls: Option<(&Path, &Path)>,
    ) -> Registry {
        let tls = match tls {
            Some((cert, key)) => format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                cert.display(),
                key.display()
            ),
            None => String::new(),
        };
        let dir = match root {
            Some(r) => tempfile::tempdir_in(r),
            None => tempfile::tempdir(),
        }
        .expect("registry temp dir");
        let mut auth = String::new();
        if let Some(entries) = htpasswd {
            let path = dir.path().join("htpasswd");
            fs::write(&path, entries).expect("htpasswd file");
            auth = format!(
                "auth:\n  htpasswd:\n    realm: basic-realm\n    path: {}\n",
                path.display()
            );
        }
        // A port picked free can be taken by a parallel test before the registry binds it; the
        // registry then exits, and starts again on a fresh port.
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free loopback port");
            let cfg = format!(
                "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  \
                 filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  \
                 addr: 127.0.0.1:{port}\n{tls}{auth}",
                dir.path().join("data").display()
            );
            let cfg_path = dir.path().join("config.yml");
            fs::write(&cfg_path, cfg).expect("registry config");
            let log = fs::File::create(dir.path().join("registry.log")).expect("registry log");
            let mut child = Command::new(REGISTRY_BIN)
                .arg("serve")
                .arg(&cfg_path)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("{REGISTRY_BIN} (bash .ci/run installs it): {e}"));
            if wait_ready(&mut child, port, dir.path()) {
                return Registry { child, port, dir };
            }
        }
        panic!("the registry found its port taken five times");
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The directory holding config, log and (under `data/`) the storage.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Where the registry stores a blob's bytes (for corruption tests).
    pub fn blob_data_path(&self, digest: &str) -> PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

/// Readiness: the port accepts connections while our registry still runs (bounded wait,
/// not a fixed sleep). False when the registry exited because its port was taken.
fn wait_ready(child: &mut Child, port: u16, dir: &Path) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = || fs::read_to_string(dir.join("registry.log")).unwrap_or_default();
        if let Ok(Some(status)) = child.try_wait() {
            let text = log();
            assert!(
                text.contains("address already in use"),
                "registry exited ({status}): {text}"
            );
            return false;
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            // A registry that lost the port exits at once; one that holds it keeps running.
            std::thread::sleep(Duration::from_millis(50));
            if matches!(child.try_wait(), Ok(None)) {
                return true;
            }
            continue;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("registry did not start: {}", log());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback TCP proxy in front of a registry that can lose it mid-transfer: after
/// [`CutProxy::cut_after`] it forwards that many more request bytes, then cuts every open
/// connection and closes new ones at once (a registry gone away) until [`CutProxy::restore`].
pub struct CutProxy {
    pub port: u16,
    state: std::sync::Arc<CutState>,
}

#[derive(Default)]
struct CutState {
    /// Request bytes still allowed through (u64::MAX = no cut armed).
    allowance: std::sync::atomic::AtomicU64,
    /// Request bytes forwarded in all.
    forwarded: std::sync::atomic::AtomicU64,
    /// Connections cut or refused while lost.
    cuts: std::sync::atomic::AtomicU64,
    conns: std::sync::Mutex<Vec<TcpStream>>,
}

impl CutState {
    fn lost(&self) -> bool {
        self.allowance.load(std::sync::atomic::Ordering::SeqCst) == 0
    }

    /// Takes up to `n` bytes of the allowance; how many may pass.
    fn take(&self, n: u64) -> u64 {
        use std::sync::atomic::Ordering::SeqCst;
        let mut left = self.allowance.load(SeqCst);
        loop {
            if left == u64::MAX {
                return n;
            }
            let pass = n.min(left);
            match self
                .allowance
                .compare_exchange(left, left - pass, SeqCst, SeqCst)
            {
                Ok(_) => return pass,
                Err(now) => left = now,
            }
        }
    }

    fn cut_all(&self) {
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(|e| e.into_inner()));
        for c in conns {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl CutProxy {
    /// Starts forwarding `127.0.0.1:<port>` to `upstream` (host:port).
    pub fn start(upstream: &str) -> CutProxy {
        use std::sync::atomic::Ordering::SeqCst;
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy port");
        let port = listener.local_addr().expect("proxy address").port();
        let state = std::sync::Arc::new(CutState::default());
        state.allowance.store(u64::MAX, SeqCst);
        let upstream = upstream.to_string();
        let st = state.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if st.lost() {
                    st.cuts.fetch_add(1, SeqCst);
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                for s in [&client, &server] {
                    if let Ok(c) = s.try_clone() {
                        st.conns.lock().unwrap_or_else(|e| e.into_inner()).push(c);
                    }
                }
                let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
                    continue;
                };
                let up = st.clone();
                std::thread::spawn(move || pump(client, server, Some(&up)));
                std::thread::spawn(move || pump(s2, c2, None));
            }
        });
        CutProxy { port, state }
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Lets `bytes` more request bytes through, then loses the registry.
    pub fn cut_after(&self, bytes: u64) {
        self.state
            .allowance
            .store(bytes, std::sync::atomic::Ordering::SeqCst);
    }

    /// The registry is back: everything passes again.
    pub fn restore(&self) {
        self.state
            .allowance
            .store(u64::MAX, std::sync::atomic::Ordering::SeqCst);
    }

    /// Connections cut mid-stream or closed at once since the start.
    pub fn cuts(&self) -> u64 {
        self.state.cuts.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Request bytes forwarded since the start.
    pub fn forwarded(&self) -> u64 {
        self.state
            .forwarded
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Copies `from` to `to`; for the request direction (`cut` given) only as far as the
/// allowance goes, after which every connection is cut.
fn pump(mut from: TcpStream, mut to: TcpStream, cut: Option<&CutState>) {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 16 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let pass = match cut {
            Some(st) => {
                let pass = st.take(n as u64) as usize;
                st.forwarded
                    .fetch_add(pass as u64, std::sync::atomic::Ordering::SeqCst);
                pass
            }
            None => n,
        };
        if pass > 0 && to.write_all(&buf[..pass]).is_err() {
            break;
        }
        if pass < n {
            if let Some(st) = cut {
                st.cuts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                st.cut_all();
            }
            break;
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}
