//! The sandbox as a little cluster for the real kubectl: logs, exec (SPDY and WebSocket), top
//! and port-forward (SPDY and SPDY tunnelled in WebSocket) go through the fake API server to the
//! daemon's kubelet API; the example manifests run.
//! Skipped with a printed reason when /usr/bin/kubectl is missing.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SANDBOX_BIN: &str = env!("CARGO_BIN_EXE_vk-cocoon-sandbox");
const KUBECTL: &str = "/usr/bin/kubectl";
const DEADLINE: Duration = Duration::from_secs(60);

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("bound address").port()
}

/// The sandbox process; interrupted (as Ctrl-C does) or killed however the test ends.
struct Sandbox {
    child: std::process::Child,
    dir: PathBuf,
    banner: std::sync::mpsc::Receiver<String>,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Sandbox {
    fn start(dir: &Path, pods: usize) -> Sandbox {
        let (metrics, kubelet) = (free_port(), free_port());
        let mut child = Command::new(SANDBOX_BIN)
            .args(["--dir", &dir.to_string_lossy(), "--pods", &pods.to_string()])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
            .args(["--kubelet-port", &kubelet.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("sandbox.log")).expect("log file"))
            .spawn()
            .expect("start the sandbox");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, banner) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let sandbox = Sandbox {
            child,
            dir: dir.to_path_buf(),
            banner,
        };
        let up = sandbox.wait_line(|l| l.contains("vk-cocoon-sandbox is up"));
        assert!(
            up.is_some(),
            "the sandbox never said it is up\n{}",
            sandbox.log()
        );
        sandbox
    }

    /// The stdout lines up to and including the first that matches, within the deadline.
    fn wait_line(&self, want: impl Fn(&str) -> bool) -> Option<Vec<String>> {
        let deadline = Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let line = self.banner.recv_timeout(left).ok()?;
            let done = want(&line);
            seen.push(line);
            if done {
                return Some(seen);
            }
        }
        None
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("sandbox.log")).unwrap_or_default()
    }

    fn kubectl(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        Command::new(KUBECTL)
            .arg("--kubeconfig")
            .arg(self.dir.join("kubeconfig"))
            .args(["--request-timeout", "30s"])
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .expect("run kubectl")
    }

    /// Runs kubectl until `ok` accepts its stdout, within the deadline; returns that stdout.
    fn kubectl_until(&self, args: &[&str], ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let out = self.kubectl(args, &[]);
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            if out.status.success() && ok(&stdout) {
                return stdout;
            }
            assert!(
                Instant::now() < deadline,
                "kubectl {args:?} never gave the expected answer:\n{stdout}\n{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn wait_running(&self, pod: &str) {
        self.kubectl_until(
            &["get", "pod", pod, "-o", "jsonpath={.status.phase}"],
            |phase| phase == "Running",
        );
    }

    /// The fake cocoon's VM list (ids of VMs whose process state is running).
    fn fake_vms(&self) -> Vec<serde_json::Value> {
        let out = Command::new(self.dir.join("bin/cocoon"))
            .args(["vm", "list", "-o", "json"])
            .env("FAKE_COCOON_STATE", self.dir.join("cocoon-state"))
            .output()
            .expect("run the fake cocoon");
        serde_json::from_slice::<Vec<serde_json::Value>>(&out.stdout).unwrap_or_default()
    }
}

/// A service in the guest: a TCP echo server on the pod's VM address (the fake guests' addresses
/// are loopback ones), counting the connections it accepted.
struct EchoGuest {
    port: u16,
    accepted: Arc<AtomicUsize>,
}

fn echo_guest(ip: &str) -> EchoGuest {
    let listener = TcpListener::bind((ip, 0)).expect("listen on the guest's address");
    let port = listener.local_addr().expect("bound address").port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            count.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut buf = [0u8; 64 * 1024];
                loop {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if conn.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                // The client's end reaches the guest; the guest's end reaches the client.
                let _ = conn.shutdown(Shutdown::Write);
            });
        }
    });
    EchoGuest { port, accepted }
}

/// A running `kubectl port-forward`; killed however the test ends.
struct PortForward {
    child: std::process::Child,
    stderr: PathBuf,
}

impl Drop for PortForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl PortForward {
    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Waits for kubectl to exit on its own; its status, or None after the deadline.
    fn wait_exit(&mut self) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + DEADLINE;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }
}

impl Sandbox {
    /// Starts `kubectl port-forward pod/POD :GUEST` and waits until it listens. kubectl picks
    /// the local port itself and names it: a port chosen here could be taken by a parallel
    /// test before kubectl binds it.
    fn port_forward(&self, pod: &str, guest_port: u16, websockets: &str) -> (PortForward, u16) {
        let stderr = self
            .dir
            .join(format!("port-forward-{pod}-{guest_port}-{websockets}.err"));
        let mut child = Command::new(KUBECTL)
            .arg("--kubeconfig")
            .arg(self.dir.join("kubeconfig"))
            .args(["port-forward", "--address", "127.0.0.1"])
            .arg(format!("pod/{pod}"))
            .arg(format!(":{guest_port}"))
            .env("KUBECTL_PORT_FORWARD_WEBSOCKETS", websockets)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("run kubectl port-forward");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let pf = PortForward { child, stderr };
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    let local = line
                        .strip_prefix("Forwarding from 127.0.0.1:")
                        .and_then(|rest| rest.split(' ').next())
                        .and_then(|port| port.parse().ok());
                    if let Some(local) = local {
                        return (pf, local);
                    }
                }
                Err(_) => panic!(
                    "kubectl port-forward never listened: {}\n{}",
                    pf.stderr(),
                    self.log()
                ),
            }
        }
    }
}

/// Sends `data` on a forwarded connection, ends its side, and returns all the guest sent back.
fn echo_through(mut conn: TcpStream, data: Vec<u8>) -> Vec<u8> {
    conn.set_read_timeout(Some(DEADLINE)).expect("read timeout");
    let mut writer = conn.try_clone().expect("clone the connection");
    let sender = std::thread::spawn(move || {
        writer.write_all(&data).expect("send through the forward");
        writer.shutdown(Shutdown::Write).expect("end our side");
    });
    let mut back = Vec::new();
    conn.read_to_end(&mut back).expect("read the echo");
    sender.join().expect("sender thread");
    back
}

/// The local addresses of every TCP socket `pid` listens on (from /proc: its socket inodes,
/// matched against the kernel's IPv4 and IPv6 tables).
fn listening_addresses(pid: u32) -> Vec<String> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
                })
                .collect()
        })
        .unwrap_or_default();
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address, state 0A = LISTEN, inode.
            if f.len() > 9 && f[3] == "0A" && inodes.iter().any(|i| i == f[9]) {
                out.push(f[1].to_string());
            }
        }
    }
    out
}

/// 127.0.0.1 in /proc/net/tcp's byte order, or ::1 / ::ffff:127.0.0.1 in tcp6's.
fn is_loopback_hex(addr: &str) -> bool {
    let ip = addr.split(':').next().unwrap_or("");
    ip == "0100007F"
        || ip == "00000000000000000000000001000000"
        || ip == "0000000000000000FFFF00000100007F"
}

fn kubectl_present() -> bool {
    if Path::new(KUBECTL).exists() {
        return true;
    }
    eprintln!("skipped: {KUBECTL} is not installed");
    false
}

#[test]
fn kubectl_logs_exec_and_top_reach_the_vms_through_the_fake_api_server() {
    if !kubectl_present() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let sandbox = Sandbox::start(dir.path(), 2);
    // demo-0 is a clone (pid 0 in the clone answer), demo-1 a fresh run.
    sandbox.wait_running("demo-0");
    sandbox.wait_running("demo-1");

    // The sandbox has no kubelet certificate files: the daemon says it serves a self-signed one.
    assert!(
        sandbox.log().contains("serving a self-signed certificate"),
        "{}",
        sandbox.log()
    );

    // Everything the sandbox listens on is on loopback: API server, kubelet, metrics, peers.
    let listening = listening_addresses(sandbox.child.id());
    assert!(listening.len() >= 3, "listening sockets: {listening:?}");
    for addr in &listening {
        assert!(is_loopback_hex(addr), "listening beyond loopback: {addr}");
    }

    // logs: the fake guest's console, through pods/log -> /containerLogs.
    let logs = sandbox.kubectl_until(&["logs", "demo-0"], |out| out.contains("vk-default-demo-0"));
    assert!(logs.contains("fake hypervisor: booting"), "{logs}");

    // exec over SPDY (kubectl's fallback protocol) and over WebSocket (its default).
    for (protocol, websockets) in [("spdy", "false"), ("websocket", "true")] {
        let out = sandbox.kubectl(
            &["exec", "demo-1", "--", "echo", "hello", protocol],
            &[("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", websockets)],
        );
        assert!(
            out.status.success(),
            "exec over {protocol}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            sandbox.log()
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("hello {protocol}")
        );
    }
    // A failing command's exit code comes back through the stream protocol.
    let failed = sandbox.kubectl(&["exec", "demo-1", "--", "false"], &[]);
    assert_eq!(failed.status.code(), Some(1), "{failed:?}");

    // top: metrics.k8s.io from the kubelet's /metrics/resource, for the clone too.
    let top = sandbox.kubectl_until(&["top", "pod", "--no-headers"], |out| {
        out.contains("demo-0") && out.contains("demo-1")
    });
    for line in top.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cols.len(), 3, "{top}");
        assert!(cols[1].ends_with('m'), "cpu column {line:?}");
        assert!(cols[2].ends_with("Mi"), "memory column {line:?}");
        assert_ne!(cols[2], "0Mi", "a running VM has a working set: {line:?}");
    }
    let node = sandbox.kubectl_until(&["top", "node", "--no-headers"], |out| {
        out.contains("cocoon-sandbox")
    });
    assert!(node.contains('%'), "{node}");

    // nodes/proxy reaches the kubelet's own paths; a pod that does not exist is the API's 404.
    let summary = sandbox.kubectl_until(
        &[
            "get",
            "--raw",
            "/api/v1/nodes/cocoon-sandbox/proxy/stats/summary",
        ],
        |out| {
            out.contains("\"nodeName\": \"cocoon-sandbox\"")
                || out.contains("\"nodeName\":\"cocoon-sandbox\"")
        },
    );
    assert!(summary.contains("demo-1"), "{summary}");
    // The cAdvisor path the kubelet ServiceMonitor scrapes, here through the API server's
    // node proxy as kubectl reaches it: the pods' container series.
    let cadvisor = sandbox.kubectl_until(
        &[
            "get",
            "--raw",
            "/api/v1/nodes/cocoon-sandbox/proxy/metrics/cadvisor",
        ],
        |out| out.contains("pod=\"demo-1\""),
    );
    assert!(
        cadvisor.lines().any(|l| l
            .starts_with("container_memory_working_set_bytes{container=\"agent\"")
            && l.contains("pod=\"demo-0\"")),
        "{cadvisor}"
    );
    let missing = sandbox.kubectl(&["logs", "no-such-pod"], &[]);
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(stderr.contains("NotFound"), "{stderr}");

    // Bodies the fake does not speak get 415, as from a real API server.
    let debug = sandbox.kubectl(
        &[
            "debug",
            "node/cocoon-sandbox",
            "--image=busybox",
            "--profile=general",
        ],
        &[],
    );
    // kubectl sends the debugging pod as protobuf, which a real API server accepts.
    let stderr = String::from_utf8_lossy(&debug.stderr);
    assert!(!debug.status.success(), "{stderr}");
    assert!(stderr.contains("UnsupportedMediaType"), "{stderr}");
}

#[test]
fn the_example_manifests_run_and_ctrl_c_removes_the_fake_vms() {
    if !kubectl_present() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let sandbox = Sandbox::start(dir.path(), 0);
    // The copies the sandbox writes beside its kubeconfig, which its banner names.
    let examples = dir.path().join("examples");
    for file in ["clone-pod.yaml", "run-pod.yaml"] {
        let repo_copy = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("packaging/examples")
            .join(file);
        assert_eq!(
            std::fs::read_to_string(examples.join(file)).ok(),
            std::fs::read_to_string(repo_copy).ok(),
            "{file}: the sandbox writes the repository's example"
        );
        let out = sandbox.kubectl(
            &["apply", "-f", &examples.join(file).to_string_lossy()],
            &[],
        );
        assert!(
            out.status.success(),
            "apply {file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    sandbox.wait_running("my-clone");
    sandbox.wait_running("my-run");
    assert_eq!(sandbox.fake_vms().len(), 2);
    // top selects by label, as metrics-server does.
    let top = sandbox.kubectl_until(&["top", "pod", "-l", "app=my-run", "--no-headers"], |out| {
        out.contains("my-run")
    });
    assert!(!top.contains("my-clone"), "{top}");

    // SIGINT, as Ctrl-C in a terminal: the daemon stops and the sandbox removes its VMs.
    let pid = sandbox.child.id().to_string();
    let sent = Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .expect("run kill");
    assert!(sent.success());
    let bye = sandbox.wait_line(|l| l.contains("rm -r"));
    assert!(
        bye.is_some(),
        "no goodbye with a cleanup hint\n{}",
        sandbox.log()
    );
    assert!(
        sandbox.fake_vms().is_empty(),
        "fake VMs left behind: {:?}",
        sandbox.fake_vms()
    );
}

#[test]
fn kubectl_port_forward_reaches_guest_ports_and_kubectl_cp_fails_clearly() {
    if !kubectl_present() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let sandbox = Sandbox::start(dir.path(), 1);
    sandbox.wait_running("demo-0");
    let ip = sandbox.kubectl_until(
        &["get", "pod", "demo-0", "-o", "jsonpath={.status.podIP}"],
        |ip| !ip.is_empty(),
    );
    assert!(ip.starts_with("127."), "fake guests live on loopback: {ip}");
    let guest = echo_guest(&ip);

    // kubectl's default (SPDY tunnelled in WebSocket) and plain SPDY: two connections at once
    // through one forward, a megabyte each way on each, the guest's end reaching the client.
    for (protocol, websockets) in [("websocket", "true"), ("spdy", "false")] {
        let before = guest.accepted.load(Ordering::SeqCst);
        let (pf, local) = sandbox.port_forward("demo-0", guest.port, websockets);
        let mut a = TcpStream::connect(("127.0.0.1", local)).expect("connect to the forward");
        let mut b = TcpStream::connect(("127.0.0.1", local)).expect("connect to the forward");
        for (conn, hello) in [(&mut a, b"hello a"), (&mut b, b"hello b")] {
            conn.set_read_timeout(Some(DEADLINE)).expect("read timeout");
            conn.write_all(hello).expect("greet the guest");
            let mut back = [0u8; 7];
            conn.read_exact(&mut back).expect("the guest's echo");
            assert_eq!(&back, hello, "over {protocol}: {}", pf.stderr());
        }
        let pattern = |seed: u8| -> Vec<u8> {
            (0..1024 * 1024u32)
                .map(|i| (i % 251) as u8 ^ seed)
                .collect()
        };
        let (da, db) = (pattern(0x5a), pattern(0xa5));
        let ta = std::thread::spawn({
            let da = da.clone();
            move || echo_through(a, da)
        });
        let back_b = echo_through(b, db.clone());
        let back_a = ta.join().expect("connection a");
        assert!(
            back_a == da,
            "over {protocol}: connection a got {} bytes back, not its own",
            back_a.len()
        );
        assert!(
            back_b == db,
            "over {protocol}: connection b got {} bytes back, not its own",
            back_b.len()
        );
        assert_eq!(
            guest.accepted.load(Ordering::SeqCst) - before,
            2,
            "over {protocol}: one guest connection per forwarded connection"
        );
        drop(pf);
    }

    // A guest port where nothing listens: kubectl reports the kubelet's error and gives up.
    let closed = {
        let l = TcpListener::bind((ip.as_str(), 0)).expect("listen on the guest's address");
        l.local_addr().expect("bound address").port()
    };
    for (protocol, websockets) in [("websocket", "true"), ("spdy", "false")] {
        let (mut pf, local) = sandbox.port_forward("demo-0", closed, websockets);
        let mut conn = TcpStream::connect(("127.0.0.1", local)).expect("connect to the forward");
        conn.set_read_timeout(Some(DEADLINE)).expect("read timeout");
        let _ = conn.write_all(b"anyone there?");
        let mut back = Vec::new();
        let _ = conn.read_to_end(&mut back);
        assert!(back.is_empty(), "over {protocol}: {back:?}");
        let status = pf.wait_exit();
        let stderr = pf.stderr();
        assert!(
            status.is_some_and(|s| !s.success()),
            "over {protocol}: {status:?} {stderr}"
        );
        assert!(
            stderr.contains(&format!(
                "error forwarding port {closed} to pod default/demo-0"
            )) && stderr.contains(&format!(
                "dial tcp {ip}:{closed}: connect: connection refused"
            )),
            "over {protocol}: {stderr}"
        );
    }

    // kubectl cp needs tar in the guest; the fake guest has none and says so, as a shell would.
    let file = dir.path().join("to-copy.txt");
    std::fs::write(&file, "some bytes\n").expect("write the file to copy");
    let cp = sandbox.kubectl(
        &["cp", &file.to_string_lossy(), "demo-0:/tmp/copied.txt"],
        &[],
    );
    let stderr = String::from_utf8_lossy(&cp.stderr);
    assert!(!cp.status.success(), "{stderr}");
    assert!(stderr.contains("tar: command not found"), "{stderr}");
    assert!(stderr.contains("exit code 127"), "{stderr}");
}
