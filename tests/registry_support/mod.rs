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
                 addr: 127.0.0.1:{port}\n{auth}",
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
