//! The README's first command: the `vk-cocoon-sandbox` binary brings up the fake API server,
//! the fake cocoon and the real daemon code, and the demo pods become running VMs.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SANDBOX_BIN: &str = env!("CARGO_BIN_EXE_vk-cocoon-sandbox");

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("0.0.0.0:0").expect("a free port");
    l.local_addr().expect("bound address").port()
}

/// Kills the sandbox however the test ends.
struct Running(std::process::Child);
impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_sandbox_binary_runs_demo_pods_as_vms() {
    let dir = tempfile::tempdir().unwrap();
    let (metrics, kubelet) = (free_port(), free_port());
    let mut child = Command::new(SANDBOX_BIN)
        .args(["--dir", &dir.path().to_string_lossy(), "--pods", "2"])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .args(["--kubelet-port", &kubelet.to_string()])
        .env("FAKE_COCOON_NO_PROCESS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("sandbox.log")).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let running = Running(child);
    let mut lines = BufReader::new(stdout).lines();
    let up = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.contains("vk-cocoon-sandbox is up"));
    assert!(up, "the sandbox never said it is up");
    // The rest of the banner is read too, so the sandbox never writes to a closed pipe.
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
    assert!(dir.path().join("kubeconfig").is_file());

    // The fake cocoon, behind the sandbox's `cocoon` symlink, lists both demo VMs running.
    let cocoon = dir.path().join("bin/cocoon");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = Command::new(&cocoon)
            .args(["vm", "list", "-o", "json"])
            .env("FAKE_COCOON_STATE", dir.path().join("cocoon-state"))
            .output()
            .unwrap();
        let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let running_vms = list
            .as_array()
            .map(|vms| {
                vms.iter()
                    .filter(|v| v.get("state").and_then(|s| s.as_str()) == Some("running"))
                    .count()
            })
            .unwrap_or(0);
        if running_vms == 2 {
            break;
        }
        let log = std::fs::read_to_string(dir.path().join("sandbox.log")).unwrap_or_default();
        assert!(
            Instant::now() < deadline,
            "demo VMs not running: {list}\n{log}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(running);
}
