//! The vk-cocoon binary as a process: command line, exit codes, /metrics, signals.
//! Network traffic goes only to 127.0.0.1; the daemon gets an unreachable API server on purpose.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_vk-cocoon");
/// The fake cocoon lives in the sandbox binary; the daemon binary no longer contains it.
const SANDBOX_BIN: &str = env!("CARGO_BIN_EXE_vk-cocoon-sandbox");

use vk_cocoon::sandbox::apiserver::{ApiServer, ApiServerHandle, ApiServerOptions, KubeconfigAuth};

struct Daemon {
    child: Child,
    metrics: SocketAddr,
    _dir: tempfile::TempDir,
    _api: Option<ApiServerHandle>,
    stderr_lines: mpsc::Receiver<String>,
    /// stderr lines up to and including the "metrics listening" line.
    startup_lines: Vec<String>,
}

/// Where the daemon's API server is.
enum Api {
    /// The embedded fake API server on loopback, with a token kubeconfig.
    Fake(ApiServerHandle),
    /// A kubeconfig whose server (127.0.0.1:1) refuses every connection.
    Unreachable,
}

/// Harmless configuration: everything under a temp dir, listeners on 127.0.0.1 port 0, the
/// fake cocoon (this binary under the name `cocoon`) with its state in the temp dir.
fn base_command(dir: &std::path::Path, api: &Api) -> Command {
    let kubeconfig = dir.join("kubeconfig");
    match api {
        Api::Fake(server) => server
            .write_kubeconfig(&kubeconfig, &KubeconfigAuth::Token("vk-binary-test".into()))
            .unwrap(),
        Api::Unreachable => std::fs::write(
            &kubeconfig,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n",
        )
        .unwrap(),
    }
    let cocoon = dir.join("cocoon");
    if !cocoon.exists() {
        std::os::unix::fs::symlink(SANDBOX_BIN, &cocoon).unwrap();
    }
    // The node's storage capacity is statfs(COCOON_ROOT_DIR): it must exist.
    std::fs::create_dir_all(dir.join("root")).unwrap();
    let d = |p: &str| dir.join(p).to_string_lossy().into_owned();
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", d(""))
        .env("OCI_REGISTRY", "127.0.0.1:1/vk-cocoon-test")
        .env("KUBECONFIG", kubeconfig.to_string_lossy().as_ref())
        .env("VK_NODE_NAME", "vk-binary-test")
        .env("VK_NODE_IP", "127.0.0.1")
        .env("VK_METRICS_ADDR", "127.0.0.1:0")
        .env("VK_PEER_ADDR", "127.0.0.1:0")
        .env("VK_KUBELET_PORT", free_port().to_string())
        .env("VK_LOG_LEVEL", "debug")
        .env("VK_TLS_CERT", d("tls.crt"))
        .env("VK_TLS_KEY", d("tls.key"))
        .env("COCOON_ROOT_DIR", d("root"))
        .env("VK_STAGING_DIR", d("staging"))
        .env("VK_STATE_DIR", d("vk-state"))
        .env("VK_COCOON_SNAPSHOT_DIR", d("snapshots"))
        .env("VK_LEASES_PATH", d("leases.json"))
        .env("VK_COCOON_NET_CONTROL_SOCKET", "")
        .env("VK_COCOON_BIN", cocoon.to_string_lossy().as_ref())
        .env("FAKE_COCOON_STATE", d("fake-cocoon"))
        .env("FAKE_COCOON_NO_PROCESS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

/// A free port for the kubelet API (VK_KUBELET_PORT refuses 0). It is picked below the
/// kernel's ephemeral range (32768 and up), so the daemon's own metrics bind to port 0 and
/// other tests' connections can never be handed the same port before the daemon binds it.
/// Each call starts its search at a new port, so parallel tests never pick the same one.
fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = 20000 + ((std::process::id() * 97 + n * 13) % 12000) as u16;
    (start..32000)
        .chain(20000..start)
        .find(|p| std::net::TcpListener::bind(("0.0.0.0", *p)).is_ok())
        .expect("a free port below the ephemeral range")
}

fn fake_api() -> Api {
    Api::Fake(ApiServer::start(ApiServerOptions::default()).expect("fake API server"))
}

fn start_with(extra: &[(&str, &str)]) -> Daemon {
    start_against(fake_api(), extra)
}

fn start_against(api: Api, extra: &[(&str, &str)]) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = base_command(dir.path(), &api);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("daemon: {line}");
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // The daemon logs the bound address: "metrics listening on http://ADDR/metrics".
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut startup_lines = Vec::new();
    let metrics = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).unwrap_or_else(|_| {
            panic!(
                "no 'metrics listening' log line; status {:?}",
                child.try_wait()
            )
        });
        let addr = line
            .split("metrics listening on http://")
            .nth(1)
            .map(|rest| {
                rest.trim_end_matches("/metrics")
                    .parse::<SocketAddr>()
                    .unwrap()
            });
        startup_lines.push(line);
        if let Some(addr) = addr {
            break addr;
        }
    };
    Daemon {
        child,
        metrics,
        _dir: dir,
        _api: match api {
            Api::Fake(h) => Some(h),
            Api::Unreachable => None,
        },
        stderr_lines: rx,
        startup_lines,
    }
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let code = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, text)
}

fn signal(child: &Child, sig: i32) {
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is our unreaped child.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

fn wait_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stop_and_check(d: &mut Daemon) {
    let start = Instant::now();
    signal(&d.child, libc::SIGTERM);
    let status = wait_within(&mut d.child, Duration::from_secs(2))
        .unwrap_or_else(|| panic!("still running {:?} after SIGTERM", start.elapsed()));
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[test]
fn sigterm_stops_with_exit_0_within_2s_and_metrics_answer_while_running() {
    let mut d = start_with(&[]);
    let (code, text) = get(d.metrics, "/metrics");
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("Content-Type: text/plain; version=0.0.4"));
    assert!(
        text.contains("# TYPE vk_cocoon_orphan_vm_total counter"),
        "{text}"
    );
    assert!(text.contains("vk_cocoon_orphan_vm_total 0"));
    let (code, _) = get(d.metrics, "/debug/nothing");
    assert_eq!(code, 404);
    stop_and_check(&mut d);
}

/// The daemon must keep serving /metrics and obey SIGTERM while the API server is down
/// (a cluster outage must not turn into a crash loop of every host daemon).
#[test]
fn metrics_and_sigterm_work_while_the_api_server_is_unreachable() {
    let mut d = start_against(Api::Unreachable, &[]);
    let (code, text) = get(d.metrics, "/metrics");
    assert_eq!(code, 200, "{text}");
    assert!(d.child.try_wait().unwrap().is_none(), "daemon exited");
    stop_and_check(&mut d);
}

#[test]
fn sigint_also_stops_cleanly_and_sighup_is_ignored() {
    let mut d = start_with(&[]);
    signal(&d.child, libc::SIGHUP);
    // The daemon logs that it ignored SIGHUP and keeps serving.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let line = d
            .stderr_lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("SIGHUP log line");
        if line.contains("SIGHUP ignored") {
            break;
        }
    }
    assert_eq!(get(d.metrics, "/metrics").0, 200);
    assert!(d.child.try_wait().unwrap().is_none());
    let start = Instant::now();
    signal(&d.child, libc::SIGINT);
    // A stop that waits on anything hangs; a loaded host only slows it.
    let status = wait_within(&mut d.child, Duration::from_secs(10)).expect("stopped");
    assert_eq!(status.code(), Some(0));
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn huge_and_unfinished_requests_do_not_stop_metrics_for_others() {
    let mut d = start_with(&[]);
    let addr = d.metrics;

    // Clients that never finish their request head.
    let mut stalled = Vec::new();
    for _ in 0..20 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: slow\r\n")
            .unwrap();
        stalled.push(s);
    }
    // A client pushing a 10 MiB request head as fast as the server lets it.
    let big = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nX-Fill: ");
        let chunk = vec![b'a'; 64 * 1024];
        let mut sent = 0usize;
        while sent < 10 << 20 {
            match s.write(&chunk) {
                Ok(n) => sent += n,
                Err(_) => break, // the server gave up on us: good
            }
        }
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        sent
    });

    for _ in 0..10 {
        let start = Instant::now();
        let (code, text) = get(addr, "/metrics");
        assert_eq!(code, 200, "{text}");
        // A server the stalled clients held would not answer at all.
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "slow answer: {:?}",
            start.elapsed()
        );
    }
    let sent = big.join().unwrap();
    assert!(
        sent < 10 << 20,
        "server read the whole 10 MiB head ({sent} bytes) instead of refusing it"
    );
    // Still answering, stalled clients still connected.
    assert_eq!(get(addr, "/metrics").0, 200);
    assert_eq!(stalled.len(), 20);
    stop_and_check(&mut d);
}

#[test]
fn invalid_configuration_exits_2_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = base_command(dir.path(), &Api::Unreachable)
        .env("VK_ORPHAN_POLICY", "nuke")
        .env("VK_LOG_LEVEL", "off")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr,
        "vk-cocoon: configuration error: VK_ORPHAN_POLICY=\"nuke\" is invalid: allowed destroy, alert or keep\n"
    );

    let out = base_command(dir.path(), &Api::Unreachable)
        .env_remove("OCI_REGISTRY")
        .env("VK_LOG_LEVEL", "off")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("OCI_REGISTRY must be set"));
}

#[test]
fn invalid_log_level_is_a_configuration_error_reported_with_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let out = base_command(dir.path(), &Api::Unreachable)
        .env("VK_LOG_LEVEL", "chatty")
        .env("VK_ORPHAN_POLICY", "nuke")
        .env("JOURNAL_STREAM", "8:1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("<3>")).collect();
    assert_eq!(errors.len(), 2, "{stderr}");
    assert!(
        errors[0].contains("invalid VK_LOG_LEVEL \"chatty\""),
        "{stderr}"
    );
    assert!(errors[1].contains("VK_ORPHAN_POLICY=\"nuke\""), "{stderr}");
}

#[test]
fn unknown_vk_variable_is_warned_about() {
    let mut d = start_with(&[("VK_NODE_NMAE", "typo")]);
    let seen = d
        .startup_lines
        .iter()
        .any(|line| line.contains("WARN") && line.contains("VK_NODE_NMAE"));
    assert!(
        seen,
        "no warning about VK_NODE_NMAE before the listener came up"
    );
    stop_and_check(&mut d);
}

#[test]
fn version_and_help() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with(&format!("vk-cocoon {} (rev ", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    assert!(text.contains(", built 20"), "{text}");

    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for word in ["run", "check-config", "vk-cocoon-sandbox", "vk-cocoon env"] {
        assert!(text.contains(word), "help lacks {word}: {text}");
    }
    // Per-command help starts nothing: without any configuration it still answers at once.
    for (command, first) in [
        ("run", "Usage: vk-cocoon [run]"),
        ("check-config", "Usage: vk-cocoon check-config"),
        ("env", "Usage: vk-cocoon env"),
    ] {
        let out = Command::new(BIN)
            .args([command, "--help"])
            .env_clear()
            .output()
            .unwrap();
        assert!(out.status.success(), "{command} --help: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.starts_with(first), "{command} --help: {text}");
    }
    let out = Command::new(BIN).arg("env").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for name in ["OCI_REGISTRY", "VK_TLS_CERT", "COCOON_K8S_QPS"] {
        assert!(text.contains(name), "env lacks {name}");
    }
    // The daemon binary carries no sandbox and no fake cocoon: those words are unknown commands.
    for word in ["frobnicate", "sandbox", "fake-cocoon"] {
        let out = Command::new(BIN).arg(word).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{word}");
    }
}

#[test]
fn the_daemon_binary_does_not_turn_into_cocoon_through_a_symlink() {
    let dir = tempfile::tempdir().unwrap();
    let cocoon = dir.path().join("cocoon");
    std::os::unix::fs::symlink(BIN, &cocoon).unwrap();
    let out = Command::new(&cocoon).args(["vm", "list"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown command"));
    // The sandbox binary does answer as the fake cocoon, under either name.
    std::fs::remove_file(&cocoon).unwrap();
    std::os::unix::fs::symlink(SANDBOX_BIN, &cocoon).unwrap();
    for mut cmd in [Command::new(&cocoon), Command::new(SANDBOX_BIN)] {
        if cmd.get_program() == SANDBOX_BIN {
            cmd.arg("fake-cocoon");
        }
        let out = cmd
            .arg("version")
            .env("FAKE_COCOON_STATE", dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
}

fn proc_field(pid: u32, file: &str, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Context switches of every thread of `pid` (each blocking wake-up counts one).
fn switches(pid: u32) -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let tid = task.file_name().to_string_lossy().into_owned();
        for f in ["voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"] {
            total += proc_field(pid, &format!("task/{tid}/status"), f);
        }
    }
    total
}

/// Benchmark (run: `cargo test --release --test process -- --ignored --nocapture binary::bench_`):
/// resident memory and wake-ups per second of an idle daemon over 10 s.
#[test]
#[ignore]
fn bench_idle_daemon_rss_and_wakeups() {
    let mut d = start_with(&[("VK_LOG_LEVEL", "info")]);
    assert_eq!(get(d.metrics, "/metrics").0, 200);
    let pid = d.child.id();
    // Let start-up settle, then count.
    std::thread::sleep(Duration::from_secs(1));
    let before = switches(pid);
    let window = Duration::from_secs(10);
    std::thread::sleep(window);
    let after = switches(pid);
    let rss_kib = proc_field(pid, "status", "VmRSS:");
    let threads = proc_field(pid, "status", "Threads:");
    println!(
        "BENCH idle daemon: RSS {:.1} MiB, {threads} threads, {:.2} wake-ups/s over {window:?}",
        rss_kib as f64 / 1024.0,
        (after - before) as f64 / window.as_secs_f64()
    );
    stop_and_check(&mut d);
}

#[test]
fn check_config_lists_every_problem_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = base_command(dir.path(), &Api::Unreachable)
        .arg("check-config")
        .stdout(Stdio::piped())
        .env_remove("OCI_REGISTRY")
        .env("VK_LOG_LEVEL", "chatty")
        .env("VK_RESTORE_MODE", "mmap   # copy, ondemand or mmap")
        .env("VK_NODE_NAME", "Not_A_Name")
        .env("VK_RESERVE_PERCENT", "150")
        .env(
            "KUBECONFIG",
            dir.path().join("absent").to_string_lossy().as_ref(),
        )
        .env(
            "HOME",
            dir.path().join("no-home").to_string_lossy().as_ref(),
        )
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let errors: Vec<&str> = stdout.lines().filter(|l| l.starts_with("FAIL ")).collect();
    for want in [
        "OCI_REGISTRY must be set",
        "VK_LOG_LEVEL \"chatty\"",
        "VK_RESTORE_MODE=",
        "VK_NODE_NAME=\"Not_A_Name\"",
        "VK_RESERVE_PERCENT=\"150\"",
        "kubeconfig: ",
    ] {
        assert!(
            errors.iter().any(|l| l.contains(want)),
            "{want} missing from:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(errors.len(), 6, "{stdout}");
    assert!(stdout.ends_with("6 problem(s) found\n"), "{stdout}");

    // A configuration the daemon would start with passes, noting the self-signed fallback
    // and naming the registry CA bundle among the trusted sources.
    let ca = dir.path().join("registry-ca.pem");
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    std::fs::write(&ca, ca_params.self_signed(&ca_key).unwrap().pem()).unwrap();
    let out = base_command(dir.path(), &Api::Unreachable)
        .arg("check-config")
        .stdout(Stdio::piped())
        .env(
            "VK_TLS_CERT",
            dir.path().join("absent.crt").to_string_lossy().as_ref(),
        )
        .env("OCI_REGISTRY_CA_FILE", &ca)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("self-signed certificate would be used"),
        "{stdout}"
    );
    let trust = format!("+ OCI_REGISTRY_CA_FILE {} (1 certificates)", ca.display());
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("registry TLS trusts ") && l.ends_with(&trust)),
        "{stdout}"
    );
    assert!(stdout.ends_with("configuration OK\n"), "{stdout}");
}
