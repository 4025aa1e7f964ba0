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
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        let mut auth = String::new();
        if let Some(entries) = htpasswd {
            let path = dir.path().join("htpasswd");
            fs::write(&path, entries).expect("htpasswd file");
            auth = format!(
                "auth:\n  htpasswd:\n    realm: basic-realm\n    path: {}\n",
                path.display()
            );
        }
        let cfg = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  \
             filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  \
             addr: 127.0.0.1:{port}\n{auth}",
            dir.path().join("data").display()
        );
        let cfg_path = dir.path().join("config.yml");
        fs::write(&cfg_path, cfg).expect("registry config");
        let log = fs::File::create(dir.path().join("registry.log")).expect("registry log");
        let child = Command::new(REGISTRY_BIN)
            .arg("serve")
            .arg(&cfg_path)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{REGISTRY_BIN} (bash .ci/run installs it): {e}"));
        let reg = Registry { child, port, dir };
        // Readiness: the port accepts connections (bounded wait, not a fixed sleep).
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "registry did not start: {}",
                fs::read_to_string(reg.dir.path().join("registry.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        reg
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

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
