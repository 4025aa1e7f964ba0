//! Harness for process tests and benchmarks of the daemon: the fake API server in the test
//! process, the real binary as the daemon, the fake cocoon behind a `cocoon` symlink, and a
//! real OCI registry (Debian's docker-registry, installed by .ci/run) on loopback.
#![allow(dead_code)]

// The registry harness is shared with the tests that use it alone; the daemon harness hands it on.
pub(crate) use crate::registry_support;

use crate::load_support;
// Not every test crate that includes this harness measures latencies.
#[allow(unused_imports)]
pub use load_support::{quiet_host, with_wakeup_probe};

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use registry_support::Registry;
use vk_cocoon::sandbox::apiserver::{ApiServer, ApiServerHandle, ApiServerOptions, KubeconfigAuth};
use vk_cocoon::sandbox::fake_cocoon::{self, FaultFile, VerbFault};
use vk_cocoon::snapshots::{push_snapshot, PushKnobs, PushRequest, RegistryClient};

pub const NODE: &str = "cocoon-sandbox";
pub const BIN: &str = env!("CARGO_BIN_EXE_vk-cocoon");
/// The fake cocoon: a binary of its own, so the daemon binary carries none of it.
pub const SANDBOX_BIN: &str = env!("CARGO_BIN_EXE_vk-cocoon-sandbox");

/// The binary a world runs as `name`: from `BENCH_BIN_DIR` when set (a bench measuring, say, the
/// static musl build the hosts run), else the one cargo built for this test.
fn world_bin(name: &str, built: &str) -> std::path::PathBuf {
    match std::env::var_os("BENCH_BIN_DIR") {
        Some(dir) => std::path::Path::new(&dir).join(name),
        None => built.into(),
    }
}
pub struct World {
    /// Shared by the worlds of one cluster (`World::beside`).
    pub api: Arc<ApiServerHandle>,
    pub registry: Arc<Registry>,
    /// VK_NODE_NAME and VK_NODE_IP of this world's daemon.
    pub node: String,
    pub node_ip: String,
    pub dir: tempfile::TempDir,
    pub metrics_port: u16,
    pub kubelet_port: u16,
    pub extra_env: Vec<(String, String)>,
    pub daemon: Option<Child>,
}

/// `N` distinct ports free on every address right now: all are held at once while picked, so
/// no two repeat (the kubelet API binds 0.0.0.0, the metrics endpoint 127.0.0.1).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("0.0.0.0:0").expect("a free port"))
        .collect();
    std::array::from_fn(|i| held[i].local_addr().expect("bound address").port())
}

impl World {
    pub fn new() -> World {
        World::new_in(&std::env::temp_dir())
    }

    /// A world whose files (the fake cocoon's state, the registry's storage) live under
    /// `parent`.
    pub fn new_in(parent: &std::path::Path) -> World {
        let api = ApiServer::start(ApiServerOptions::default()).expect("fake API server");
        let dir = tempfile::tempdir_in(parent).expect("temp dir");
        let registry = Registry::start(Some(dir.path()), None);
        World::in_cluster(Arc::new(api), Arc::new(registry), dir, NODE, "127.0.0.1")
    }

    /// Another node of this world's cluster: the same API server and registry, a fake cocoon
    /// state of its own, a daemon of its own named `node` at `node_ip`.
    pub fn beside(&self, node: &str, node_ip: &str) -> World {
        let dir = tempfile::tempdir().expect("temp dir");
        World::in_cluster(self.api.clone(), self.registry.clone(), dir, node, node_ip)
    }

    /// A node of the cluster of `api` and `registry` whose files live under `parent`: a daemon
    /// of its own named `node` at `node_ip`, a fake cocoon state of its own (a fleet's node).
    pub fn join(
        api: Arc<ApiServerHandle>,
        registry: Arc<Registry>,
        parent: &std::path::Path,
        node: &str,
        node_ip: &str,
    ) -> World {
        let dir = tempfile::tempdir_in(parent).expect("temp dir");
        World::in_cluster(api, registry, dir, node, node_ip)
    }

    fn in_cluster(
        api: Arc<ApiServerHandle>,
        registry: Arc<Registry>,
        dir: tempfile::TempDir,
        node: &str,
        node_ip: &str,
    ) -> World {
        for d in ["state", "root", "bin", "net"] {
            std::fs::create_dir_all(dir.path().join(d)).expect("mkdir");
        }
        std::os::unix::fs::symlink(
            world_bin("vk-cocoon-sandbox", SANDBOX_BIN),
            dir.path().join("bin/cocoon"),
        )
        .expect("symlink");
        // The fake finds its state beside the symlink when the environment names none, as for
        // the snapshot transfers this test process runs itself.
        std::os::unix::fs::symlink(
            dir.path().join("state"),
            dir.path().join("bin/fake-cocoon-state"),
        )
        .expect("symlink");
        api.write_kubeconfig(
            &dir.path().join("kubeconfig"),
            // The fake's authority writes one O, the last group: a node's, as a kubelet's
            // certificate has (the peer listener checks it); the API server knows both.
            &KubeconfigAuth::ClientCert {
                user: format!("system:node:{node}"),
                groups: vec!["system:masters".into(), "system:nodes".into()],
            },
        )
        .expect("kubeconfig");
        let [metrics_port, kubelet_port] = free_ports();
        World {
            api,
            registry,
            node: node.into(),
            node_ip: node_ip.into(),
            dir,
            metrics_port,
            kubelet_port,
            extra_env: Vec::new(),
            daemon: None,
        }
    }

    /// A world whose fake cocoon plays cocoon-net: DHCP NICs and the lease file the daemon
    /// reads (an all-DHCP clone then turns Ready on its lease, with no post-clone fix-up).
    pub fn dhcp() -> World {
        let mut w = World::new();
        let leases = w.path("net/leases.json");
        w.extra_env = vec![
            ("FAKE_COCOON_DHCP".into(), "1".into()),
            ("FAKE_COCOON_LEASES".into(), leases.display().to_string()),
        ];
        w
    }

    /// Makes the fake cocoon's `verb` (`"vm net"`, `"vm exec"`, ...) misbehave as `f` says
    /// (replacing any fault set before).
    pub fn set_fault(&self, verb: &str, f: VerbFault) {
        let mut faults = FaultFile::new();
        faults.insert(verb.into(), f);
        fake_cocoon::write_faults(&self.path("state"), &faults).expect("faults");
    }

    /// Makes the fake cocoon behave again.
    pub fn clear_faults(&self) {
        fake_cocoon::write_faults(&self.path("state"), &FaultFile::new()).expect("faults");
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// Starts the daemon and waits until its listeners are bound. A port picked free can be
    /// taken by a parallel test before the daemon binds it; the daemon then exits at startup
    /// and is started again on fresh ports.
    pub fn start_daemon(&mut self) {
        for _ in 0..5 {
            self.daemon = Some(self.spawn_daemon());
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let log = self.log();
                if log.contains("kubelet API listening on") {
                    return;
                }
                let exited = self
                    .daemon
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten());
                if exited.is_some() && log.contains("Address already in use") {
                    break;
                }
                assert!(
                    exited.is_none() && Instant::now() < deadline,
                    "the daemon did not start listening ({exited:?})\n{}",
                    tail(&log, 60)
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            self.kill_daemon();
            [self.metrics_port, self.kubelet_port] = free_ports();
        }
        panic!("the daemon found its ports taken five times");
    }

    /// Starts the daemon and returns at once (`start_daemon` waits for its listeners).
    pub fn spawn_daemon(&self) -> Child {
        let log = std::fs::File::create(self.path("daemon.log")).expect("log file");
        Command::new(world_bin("vk-cocoon", BIN))
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", self.dir.path())
            .env("KUBECONFIG", self.path("kubeconfig"))
            .env("VK_LOG_LEVEL", "debug")
            .env("VK_NODE_NAME", &self.node)
            .env("VK_NODE_IP", &self.node_ip)
            .env("VK_COCOON_BIN", self.path("bin/cocoon"))
            .env("FAKE_COCOON_STATE", self.path("state"))
            .env("COCOON_ROOT_DIR", self.path("root"))
            .env("VK_LEASES_PATH", self.path("net/leases.json"))
            .env("VK_COCOON_NET_CONTROL_SOCKET", "")
            .env(
                "VK_METRICS_ADDR",
                format!("127.0.0.1:{}", self.metrics_port),
            )
            .env("VK_KUBELET_PORT", self.kubelet_port.to_string())
            .env("VK_TLS_CERT", "")
            .env("VK_TLS_KEY", "")
            .env("VK_STAGING_DIR", self.path("staging"))
            .env("VK_STATE_DIR", self.path("vk-state"))
            .env("VK_PEER_ADDR", "127.0.0.1:0")
            .env("VK_COCOON_SNAPSHOT_DIR", self.path("state/snapshots"))
            .env("OCI_REGISTRY", self.registry_base())
            .env("COCOON_K8S_QPS", "0")
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn vk-cocoon")
    }

    /// The daemon's OCI_REGISTRY: a repository prefix on this world's registry.
    pub fn registry_base(&self) -> String {
        format!("{}/vk", self.registry.host())
    }

    /// A registry client for this world's registry, as the daemon configures it.
    pub fn registry_client(&self) -> RegistryClient {
        RegistryClient::from_env(&self.registry_base(), None).expect("registry client")
    }

    /// Pushes the fake's local snapshot `name` to `<OCI_REGISTRY>/<name>:<tag>` as this node's
    /// daemon pushes a VM's snapshot (with its from-node, no owner: an older daemon's push).
    pub fn push_snapshot(&self, name: &str, tag: &str, base_image: &str) {
        self.push_snapshot_as(name, tag, base_image, Some(&self.node), BTreeMap::new());
    }

    /// Publishes the fake's local snapshot `name` as a base image (no daemon annotations), as
    /// an operator's tooling publishes the golden snapshots pods clone.
    pub fn push_base_snapshot(&self, name: &str, tag: &str) {
        self.push_snapshot_as(name, tag, "", None, BTreeMap::new());
    }

    /// Pushes local snapshot `name` to `<name>:<tag>` with these from-node and annotations.
    pub fn push_snapshot_as(
        &self,
        name: &str,
        tag: &str,
        base_image: &str,
        from_node: Option<&str>,
        annotations: BTreeMap<String, String>,
    ) {
        let req = PushRequest {
            name: name.into(),
            tag: tag.into(),
            cocoon_bin: self.path("bin/cocoon"),
            base_image: Some(base_image.to_string()).filter(|b| !b.is_empty()),
            from_node: from_node.map(str::to_string),
            annotations,
            knobs: PushKnobs::default(),
            temp_dir: Some(self.dir.path().to_path_buf()),
        };
        push_snapshot(&self.registry_client(), &req).expect("push snapshot");
    }

    pub fn delete_tag(&self, name: &str, tag: &str) {
        let client = self.registry_client();
        let r = client.reference(name, tag).expect("reference");
        client.delete_manifest(&r).expect("delete tag");
    }

    pub fn kill_daemon(&mut self) {
        if let Some(mut c) = self.daemon.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The daemon's /metrics text.
    pub fn metrics(&self) -> String {
        ureq::get(&format!("http://127.0.0.1:{}/metrics", self.metrics_port))
            .call()
            .expect("metrics")
            .into_body()
            .read_to_string()
            .expect("metrics text")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.path("daemon.log")).unwrap_or_default()
    }

    /// Runs the fake cocoon against this world's state.
    pub fn cocoon(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(self.path("bin/cocoon"))
            .args(args)
            .env("FAKE_COCOON_STATE", self.path("state"))
            .env("COCOON_ROOT_DIR", self.path("root"))
            .output()
            .expect("run fake cocoon");
        let text = if out.status.success() {
            String::from_utf8_lossy(&out.stdout).into_owned()
        } else {
            String::from_utf8_lossy(&out.stderr).into_owned()
        };
        (out.status.success(), text)
    }

    /// VM name → (id, state) as the fake cocoon lists them.
    pub fn vms(&self) -> BTreeMap<String, (String, String)> {
        let (ok, out) = self.cocoon(&["vm", "list", "-o", "json"]);
        assert!(ok, "vm list failed: {out}");
        let list: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap_or_default();
        list.iter()
            .map(|v| {
                let name = v["config"]["name"].as_str().unwrap_or("").to_string();
                let id = v["id"].as_str().unwrap_or("").to_string();
                let state = v["state"].as_str().unwrap_or("").to_string();
                (name, (id, state))
            })
            .collect()
    }

    /// Whether a `<bin> <group> <verb> ...` process of this world's fake cocoon is alive
    /// (the daemon, or a daemon killed before, is in that step).
    pub fn cocoon_running(&self, group: &str, verb: &str) -> bool {
        let bin = self.path("bin/cocoon");
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return false;
        };
        dir.flatten().any(|e| {
            let Ok(raw) = std::fs::read(e.path().join("cmdline")) else {
                return false;
            };
            let argv: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
            argv.len() >= 3
                && argv[0] == bin.as_os_str().as_encoded_bytes()
                && argv[1] == group.as_bytes()
                && argv[2] == verb.as_bytes()
        })
    }

    pub fn seed_snapshot(&self, name: &str) {
        self.seed_snapshot_with(name, &[]);
    }

    /// A snapshot `name` of a VM run from ubuntu:24.04 with the extra `vm run` flags (`--fc`).
    pub fn seed_snapshot_with(&self, name: &str, run_flags: &[&str]) {
        assert!(self.cocoon(&["image", "pull", "ubuntu:24.04"]).0);
        let mut args = vec!["vm", "run", "--output", "json"];
        args.extend_from_slice(run_flags);
        args.extend(["--name", "seed", "ubuntu:24.04"]);
        let (ok, out) = self.cocoon(&args);
        assert!(ok, "{out}");
        let id = serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(self.cocoon(&["snapshot", "save", "--name", name, &id]).0);
        assert!(self.cocoon(&["vm", "rm", "--force", &id]).0);
    }

    pub fn wait<T>(&self, what: &str, limit: Duration, f: impl FnMut() -> Option<T>) -> T {
        self.wait_or_none(limit, f).unwrap_or_else(|| {
            panic!(
                "timed out after {limit:?} waiting for {what}\n--- daemon log (tail) ---\n{}",
                tail(&self.log(), 60)
            )
        })
    }

    pub fn pod(&self, name: &str) -> Option<Pod> {
        self.api.get_pod("default", name)
    }

    pub fn events_for(&self, name: &str) -> Vec<(String, String)> {
        self.api
            .list_objects("events")
            .iter()
            .filter(|e| e["involvedObject"]["name"] == name)
            .map(|e| {
                (
                    e["reason"].as_str().unwrap_or("").to_string(),
                    e["message"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    }

    /// Waits until pod `name` has an Event `reason` whose message `message` accepts; returns
    /// the pod's Events then. Events leave through the kube lane after every pod write and
    /// on workers of their own, so one may land well after the state a test saw: a test that
    /// asserts on an Event waits for it.
    pub fn wait_event(
        &self,
        name: &str,
        reason: &str,
        message: impl Fn(&str) -> bool,
    ) -> Vec<(String, String)> {
        self.wait(&format!("a {reason} Event on {name}"), SETTLE_LIMIT, || {
            let events = self.events_for(name);
            events
                .iter()
                .any(|(r, m)| r == reason && message(m))
                .then_some(events)
        })
    }

    /// Waits until the /metrics series `series` (labels included) reads `want`; returns the
    /// /metrics text then. A counter may move on another thread than the write a test saw.
    pub fn wait_metric(&self, series: &str, want: f64) -> String {
        let mut last = None;
        let found = self.wait_or_none(SETTLE_LIMIT, || {
            let text = self.metrics();
            last = metric_value(&text, series);
            (last == Some(want)).then_some(text)
        });
        found.unwrap_or_else(|| {
            panic!(
                "timed out after {SETTLE_LIMIT:?} waiting for {series} = {want} (last {last:?})\n{}",
                tail(&self.log(), 60)
            )
        })
    }

    /// Polls `f` until it returns Some or `limit` passes.
    fn wait_or_none<T>(&self, limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
        let start = Instant::now();
        loop {
            if let Some(v) = f() {
                return Some(v);
            }
            if start.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// How long a test waits for something that follows a state it already saw (an Event, a
/// counter, a log line): a failure bound for a loaded host, not a latency the test asserts.
pub const SETTLE_LIMIT: Duration = Duration::from_secs(60);

impl Drop for World {
    fn drop(&mut self) {
        self.kill_daemon();
        // Stop the fake's sleeping VM processes: they exit once their records are gone.
        let _ = std::fs::remove_dir_all(self.path("state"));
    }
}

pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

pub fn phase(p: &Pod) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default()
}

pub fn annotation(p: &Pod, key: &str) -> Option<String> {
    p.metadata.annotations.as_ref()?.get(key).cloned()
}

impl World {
    /// Seeds snapshot `base`, starts the daemon and creates pod `web` cloned from it: the pod
    /// and its VM id once it runs with a VM.
    pub fn run_web_pod(&mut self) -> (Pod, String) {
        self.seed_snapshot("base");
        self.start_daemon();
        self.api
            .create_pod(&vk_cocoon::sandbox::demo_pod(
                "default", "web", "clone", "base",
            ))
            .expect("create pod");
        self.wait("pod web Running with a VM id", SETTLE_LIMIT, || {
            running_with_vm(self, "web")
        })
    }
}

pub fn running_with_vm(w: &World, name: &str) -> Option<(Pod, String)> {
    let p = w.pod(name)?;
    let id = annotation(&p, "vm.cocoonstack.io/id")?;
    (phase(&p) == "Running" && !id.is_empty()).then_some((p, id))
}

/// Seconds since the node Lease's renewTime (what the node lifecycle controller looks at).
pub fn lease_age(w: &World) -> Option<f64> {
    let v = w.api.get_object("leases", "kube-node-lease", NODE)?;
    let lease: k8s_openapi::api::coordination::v1::Lease = serde_json::from_value(v).ok()?;
    let renewed = lease.spec?.renew_time?.0.as_microsecond();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_micros() as i64;
    Some((now - renewed) as f64 / 1e6)
}

/// The value of the first /metrics line starting with `name` (labels included in `name`).
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
}

/// Writes (create, update, patch, delete) the daemon sent to pods whose name starts with
/// `prefix`, per pod of `pods`: status, annotation and delete calls alike.
pub fn pod_writes_per_pod(w: &World, prefix: &str, pods: usize) -> f64 {
    let needle = format!("/pods/{prefix}");
    let writes = w
        .api
        .requests()
        .iter()
        .filter(|r| matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete"))
        .filter(|r| r.resource.starts_with("pods") && r.path.contains(&needle))
        .count();
    writes as f64 / pods.max(1) as f64
}

/// Sets annotation `key` of pod `name` to `value`, retrying on a resourceVersion conflict (the
/// daemon writes the pod too).
pub fn set_annotation(w: &World, name: &str, key: &str, value: &str) {
    edit_annotations(w, name, |a| {
        a.insert(key.into(), value.into());
    });
}

/// Updates pod `name` with its annotations changed by `edit`, retrying on a resourceVersion
/// conflict (the daemon writes the pod too, at any moment).
pub fn edit_annotations(w: &World, name: &str, edit: impl Fn(&mut BTreeMap<String, String>)) {
    for _ in 0..100 {
        let mut p = w.pod(name).expect("pod");
        edit(p.metadata.annotations.get_or_insert_with(Default::default));
        if w.api.update_pod(&p).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("could not update the annotations of {name}");
}

/// Asks pod `name` to hibernate (`on`) or to wake.
pub fn set_hibernate(w: &World, name: &str, on: bool) {
    set_annotation(w, name, "vm.cocoonstack.io/hibernate", &on.to_string());
}

/// `p` with annotation `k` set to `v`.
pub fn with_annotation(mut p: Pod, k: &str, v: &str) -> Pod {
    p.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(k.into(), v.into());
    p
}

/// The guest commands the fake cocoon ran (its exec log), in order: (VM id, argv).
pub fn execs(w: &World) -> Vec<(String, Vec<String>)> {
    std::fs::read_to_string(w.path("state/exec.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            let argv = v["argv"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|x| x.as_str().unwrap_or("").to_string())
                        .collect()
                })
                .unwrap_or_default();
            (v["vm"].as_str().unwrap_or("").to_string(), argv)
        })
        .collect()
}

/// PIDs of this world's cocoon children running `cocoon <group> <verb> ...` (read from
/// /proc).
pub fn cocoon_children(w: &World, group: &str, verb: &str) -> Vec<u32> {
    let bin = w.path("bin/cocoon").display().to_string();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
        let hit = args
            .windows(3)
            .any(|a| a[0] == bin.as_bytes() && a[1] == group.as_bytes() && a[2] == verb.as_bytes());
        // A zombie has an empty cmdline: only live processes match.
        if hit {
            pids.push(pid);
        }
    }
    pids
}

/// The loop keeps turning: /metrics answers and the node Lease was renewed within `bound`
/// (it is renewed every 10 s and lasts 40 s). Panics with what it saw otherwise.
pub fn assert_loop_turns(w: &World, bound: f64) {
    let age = lease_age(w).unwrap_or(f64::MAX);
    assert!(
        age < bound,
        "the node Lease is {age:.1} s old (bound {bound} s)\n{}",
        tail(&w.log(), 30)
    );
    let m = ureq::get(&format!("http://127.0.0.1:{}/metrics", w.metrics_port))
        .config()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .call();
    assert!(m.is_ok(), "/metrics does not answer: {m:?}");
}

/// Waits for `f`, checking that the loop keeps turning (`assert_loop_turns`) while it waits.
pub fn wait_turning<T>(
    w: &World,
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let mut last_check = Instant::now();
    w.wait(what, limit, || {
        if last_check.elapsed() > Duration::from_millis(500) {
            assert_loop_turns(w, 30.0);
            last_check = Instant::now();
        }
        f()
    })
}

/// (reason, message) of the Warning Events of pod `name`.
pub fn warnings_for(w: &World, name: &str) -> Vec<(String, String)> {
    w.api
        .list_objects("events")
        .iter()
        .filter(|e| e["involvedObject"]["name"] == name && e["type"] == "Warning")
        .map(|e| {
            (
                e["reason"].as_str().unwrap_or("").to_string(),
                e["message"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// Waits for a Warning of pod `name` with `reason` whose message contains `needle`.
pub fn wait_warning(w: &World, name: &str, reason: &str, needle: &str) -> String {
    w.wait(
        &format!("Warning {reason} ({needle}) on {name}"),
        Duration::from_secs(30),
        || {
            warnings_for(w, name)
                .into_iter()
                .find(|(r, m)| r == reason && m.contains(needle))
                .map(|(_, m)| m)
        },
    )
}

/// How many times pod `name` was warned with `reason` (identical Events aggregate into one
/// with a count).
pub fn warning_count(w: &World, name: &str, reason: &str) -> u64 {
    w.api
        .list_objects("events")
        .iter()
        .filter(|e| {
            e["involvedObject"]["name"] == name && e["type"] == "Warning" && e["reason"] == reason
        })
        .map(|e| e["count"].as_u64().unwrap_or(1))
        .sum()
}

/// SIGKILLs the hypervisor process of VM `id` (its PID as cocoon reports it); returns the PID.
pub fn kill_hypervisor(w: &World, id: &str) -> i32 {
    let (ok, out) = w.cocoon(&["vm", "inspect", id]);
    assert!(ok, "{out}");
    let pid = serde_json::from_str::<serde_json::Value>(&out).unwrap_or_default()["pid"]
        .as_i64()
        .unwrap_or(0);
    let hypervisor = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .expect("the VM has a hypervisor PID");
    rustix::process::kill_process(hypervisor, rustix::process::Signal::KILL).expect("kill");
    hypervisor.as_raw_nonzero().get()
}

/// Status of `GET /pods` on the kubelet API with a bearer token.
pub fn kubelet_status(w: &World, token: &str) -> String {
    let out = std::process::Command::new("curl")
        .args([
            "-sk",
            "--max-time",
            "5",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .args(["-H", &format!("Authorization: Bearer {token}")])
        .arg(format!("https://127.0.0.1:{}/pods", w.kubelet_port))
        .output()
        .expect("run curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The local snapshot names the fake cocoon lists.
pub fn snapshot_names(w: &World) -> std::collections::BTreeSet<String> {
    let (ok, out) = w.cocoon(&["snapshot", "list", "-o", "json"]);
    assert!(ok, "{out}");
    let list: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap_or_default();
    list.iter()
        .filter_map(|s| s["name"].as_str().map(str::to_string))
        .collect()
}

/// Pod `name` is hibernated: lifecycle `hibernated` and no VM `vm` left.
pub fn hibernated(w: &World, name: &str, vm: &str) -> Option<()> {
    let p = w.pod(name)?;
    let done = annotation(&p, "vm.cocoonstack.io/lifecycle-state").as_deref() == Some("hibernated")
        && !w.vms().contains_key(vm);
    done.then_some(())
}

/// TokenReviews the daemon has sent (the kubelet API authenticating bearer tokens).
pub fn token_reviews(w: &World) -> usize {
    w.api
        .requests()
        .iter()
        .filter(|r| r.resource == "tokenreviews")
        .count()
}
