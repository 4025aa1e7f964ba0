//! The embedded sandbox: a fake Kubernetes API server and a fake cocoon for tests and demos.
//! Test infrastructure that follows the specs; the daemon itself never depends on it.
//!
//! Compiled only with the `sandbox` cargo feature (the tests turn it on), so building the daemon
//! compiles none of it.
//!
//! `vk-cocoon-sandbox` (its own binary; the daemon binary links none of this) runs the real
//! daemon code in this process against the fake API server
//! (HTTPS on loopback, threads of this process) and the fake cocoon (this binary re-executed as
//! `cocoon` through a symlink), writes a kubeconfig that kubectl can use, creates a few demo pods
//! and prints what to run. Every address involved is on loopback.

pub mod apiserver;
pub mod fake_cocoon;
pub mod fake_cocoon_macos;
pub mod fake_sac;

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;

use self::apiserver::{ApiServer, ApiServerOptions, KubeconfigAuth};

/// The example pods of packaging/examples, written into the sandbox directory so the printed
/// `kubectl apply` lines work from any working directory.
const EXAMPLES: [(&str, &str); 2] = [
    (
        "clone-pod.yaml",
        include_str!("../../packaging/examples/clone-pod.yaml"),
    ),
    (
        "run-pod.yaml",
        include_str!("../../packaging/examples/run-pod.yaml"),
    ),
];

const USAGE: &str = "\
Usage: vk-cocoon-sandbox [--dir DIR] [--pods N] [--api-port PORT] [--metrics-addr ADDR]
                         [--kubelet-port PORT] [--registry HOST[:PORT][/PREFIX]]
       vk-cocoon-sandbox fake-cocoon ARGS   (the fake `cocoon` CLI; also when run as `cocoon`)
       vk-cocoon-sandbox --version

Runs vk-cocoon against an in-process fake Kubernetes API server and the fake cocoon, all on
loopback. DIR (default: a fresh directory under /tmp) holds the kubeconfig, the fake cocoon's
state and the cocoon root. Snapshot transfers use a registry only when --registry is given.
";

/// Sandbox settings from the command line.
#[derive(Debug, Clone)]
pub struct SandboxOptions {
    pub dir: Option<PathBuf>,
    pub pods: usize,
    pub api_port: u16,
    pub metrics_addr: String,
    pub kubelet_port: u16,
    pub registry: Option<String>,
}

impl Default for SandboxOptions {
    fn default() -> Self {
        SandboxOptions {
            dir: None,
            pods: 3,
            api_port: 0,
            metrics_addr: "127.0.0.1:9091".into(),
            kubelet_port: 10250,
            registry: None,
        }
    }
}

/// Parses the arguments after `sandbox`.
pub fn parse_args(args: &[String]) -> Result<SandboxOptions, String> {
    let mut o = SandboxOptions::default();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--dir" => o.dir = Some(PathBuf::from(value()?)),
            "--pods" => {
                let v = value()?;
                o.pods = v
                    .parse()
                    .map_err(|_| format!("--pods {v:?}: not a count"))?;
            }
            "--api-port" => {
                let v = value()?;
                o.api_port = v
                    .parse()
                    .map_err(|_| format!("--api-port {v:?}: not a port"))?;
            }
            "--metrics-addr" => o.metrics_addr = value()?,
            "--kubelet-port" => {
                let v = value()?;
                o.kubelet_port = v
                    .parse()
                    .map_err(|_| format!("--kubelet-port {v:?}: not a port"))?;
            }
            "--registry" => o.registry = Some(value()?),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(o)
}

/// Entry point of `vk-cocoon-sandbox ...`: `args` are the arguments after the program name.
/// Returns the process exit code.
pub fn run_sandbox(args: Vec<String>) -> i32 {
    let opts = match parse_args(&args) {
        Ok(o) => o,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            return 0;
        }
        Err(e) => {
            eprintln!("vk-cocoon-sandbox: {e}\n{USAGE}");
            return 2;
        }
    };
    let level = std::env::var("VK_LOG_LEVEL").ok();
    if let Err(e) = crate::logging::init(level.as_deref()) {
        eprintln!("log setup: {e}");
        return 1;
    }
    match Sandbox::prepare(&opts) {
        Ok(sandbox) => sandbox.run(&opts),
        Err(e) => {
            eprintln!("vk-cocoon-sandbox: {e}");
            1
        }
    }
}

/// A prepared sandbox: directories, the cocoon symlink and the running fake API server.
pub struct Sandbox {
    pub dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub cocoon: PathBuf,
    pub state: PathBuf,
    /// The fake `cocoon-macos` (a symlink to this binary) and its state directory.
    pub cocoon_macos: PathBuf,
    pub macos_state: PathBuf,
    pub api: apiserver::ApiServerHandle,
}

impl Sandbox {
    /// Creates the directory layout, starts the fake API server and writes the kubeconfig.
    pub fn prepare(opts: &SandboxOptions) -> Result<Sandbox, String> {
        let dir = match &opts.dir {
            Some(d) => d.clone(),
            None => std::env::temp_dir().join(format!("vk-cocoon-sandbox-{}", std::process::id())),
        };
        let state = dir.join("cocoon-state");
        let macos_state = dir.join("cocoon-macos-state");
        let bin = dir.join("bin");
        let examples = dir.join("examples");
        for d in [
            &dir,
            &state,
            &macos_state,
            &bin,
            &dir.join("root"),
            &dir.join("net"),
            &examples,
        ] {
            std::fs::create_dir_all(d).map_err(|e| format!("create {}: {e}", d.display()))?;
        }
        for (name, text) in EXAMPLES {
            let path = examples.join(name);
            std::fs::write(&path, text).map_err(|e| format!("write {}: {e}", path.display()))?;
        }
        let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
        let cocoon = bin.join("cocoon");
        let _ = std::fs::remove_file(&cocoon);
        std::os::unix::fs::symlink(&exe, &cocoon)
            .map_err(|e| format!("symlink {}: {e}", cocoon.display()))?;
        let cocoon_macos = bin.join("cocoon-macos");
        let _ = std::fs::remove_file(&cocoon_macos);
        std::os::unix::fs::symlink(&exe, &cocoon_macos)
            .map_err(|e| format!("symlink {}: {e}", cocoon_macos.display()))?;

        let api = ApiServer::start(ApiServerOptions {
            port: opts.api_port,
            ..ApiServerOptions::default()
        })
        .map_err(|e| format!("fake API server: {e}"))?;
        let kubeconfig = dir.join("kubeconfig");
        api.write_kubeconfig(
            &kubeconfig,
            &KubeconfigAuth::ClientCert {
                user: "system:node:cocoon-sandbox".into(),
                groups: vec!["system:nodes".into(), "system:masters".into()],
            },
        )
        .map_err(|e| format!("write kubeconfig: {e}"))?;
        Ok(Sandbox {
            dir,
            kubeconfig,
            cocoon,
            state,
            cocoon_macos,
            macos_state,
            api,
        })
    }

    /// The daemon's environment for this sandbox (everything on loopback).
    pub fn env(&self, opts: &SandboxOptions) -> Vec<(String, String)> {
        let p = |p: &Path| p.to_string_lossy().into_owned();
        let mut env = vec![
            ("KUBECONFIG", p(&self.kubeconfig)),
            ("VK_NODE_NAME", "cocoon-sandbox".to_string()),
            ("VK_NODE_IP", "127.0.0.1".to_string()),
            ("VK_COCOON_BIN", p(&self.cocoon)),
            ("FAKE_COCOON_STATE", p(&self.state)),
            ("COCOON_ROOT_DIR", p(&self.dir.join("root"))),
            ("VK_LEASES_PATH", p(&self.dir.join("net/leases.json"))),
            // The fake plays cocoon-net too: DHCP NICs whose (loopback) addresses appear in the
            // lease file, as on a real host, so clones need no static-IP fix-up.
            ("FAKE_COCOON_DHCP", "1".to_string()),
            ("FAKE_COCOON_LEASES", p(&self.dir.join("net/leases.json"))),
            // Managed macOS pods run on the fake cocoon-macos (each QEMU a `sleep`), whose
            // guests get loopback leases in the same file, and a VNC display each.
            ("VK_COCOON_MACOS_BIN", p(&self.cocoon_macos)),
            ("FAKE_COCOON_MACOS_STATE", p(&self.macos_state)),
            (
                "FAKE_COCOON_MACOS_LEASES",
                p(&self.dir.join("net/leases.json")),
            ),
            ("COCOON_MACOS_VNC_PASSWORD", "sandbox".to_string()),
            ("VK_COCOON_NET_CONTROL_SOCKET", String::new()),
            ("VK_METRICS_ADDR", opts.metrics_addr.clone()),
            // The snapshot peer server listens on every interface by default.
            ("VK_PEER_ADDR", "127.0.0.1:0".to_string()),
            ("VK_KUBELET_PORT", opts.kubelet_port.to_string()),
            ("VK_TLS_CERT", String::new()),
            ("VK_TLS_KEY", String::new()),
            ("VK_STAGING_DIR", p(&self.dir.join("staging"))),
            ("VK_STATE_DIR", p(&self.dir.join("vk-state"))),
            // The fake cocoon keeps each snapshot's data files in `snapshots/<ID>/`.
            ("VK_COCOON_SNAPSHOT_DIR", p(&self.state.join("snapshots"))),
            (
                "OCI_REGISTRY",
                opts.registry
                    .clone()
                    .unwrap_or_else(|| "sandbox.invalid".into()),
            ),
        ];
        // The sandbox kubeconfig's client certificate is in system:masters; the kubelet API
        // still authenticates callers: kubectl logs/exec/top reach it through the fake API
        // server, which presents its own kubelet client certificate.
        env.push(("VK_KUBELET_AUTH", "on".to_string()));
        env.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    /// Creates `n` demo pods bound to the sandbox node (seeding a snapshot for clone mode).
    pub fn create_demo_pods(&self, n: usize) -> Result<(), String> {
        self.seed_snapshot("demo-base")?;
        for i in 0..n {
            let mode = if i % 2 == 0 { "clone" } else { "run" };
            let image = if mode == "clone" {
                "demo-base"
            } else {
                "ubuntu:24.04"
            };
            let pod = demo_pod("default", &format!("demo-{i}"), mode, image);
            self.api
                .create_pod(&pod)
                .map_err(|e| format!("create demo pod: {e:?}"))?;
        }
        Ok(())
    }

    /// A local snapshot named `name` in the fake cocoon (run a VM, save it, remove the VM).
    fn seed_snapshot(&self, name: &str) -> Result<(), String> {
        let run = |args: &[&str]| -> Result<String, String> {
            let out = std::process::Command::new(&self.cocoon)
                .args(args)
                .env("FAKE_COCOON_STATE", &self.state)
                .env("COCOON_ROOT_DIR", self.dir.join("root"))
                .output()
                .map_err(|e| format!("fake cocoon: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "fake cocoon {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        };
        if run(&["snapshot", "inspect", name]).is_ok() {
            return Ok(());
        }
        let seed = format!("{name}-seed");
        run(&["image", "pull", "ubuntu:24.04"])?;
        let vm = run(&[
            "vm",
            "run",
            "--output",
            "json",
            "--name",
            &seed,
            "ubuntu:24.04",
        ])?;
        let id = serde_json::from_str::<serde_json::Value>(&vm)
            .ok()
            .and_then(|v| v.get("id").and_then(|i| i.as_str()).map(str::to_string))
            .ok_or("fake cocoon vm run printed no id")?;
        run(&["snapshot", "save", "--name", name, &id])?;
        run(&["vm", "rm", "--force", &id])?;
        Ok(())
    }

    fn run(self, opts: &SandboxOptions) -> i32 {
        // Set before the daemon starts any thread of its own; the API server's threads never
        // read the environment.
        for (k, v) in self.env(opts) {
            std::env::set_var(k, v);
        }
        let mut config = match crate::config::Config::from_process_env() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("vk-cocoon-sandbox: configuration error: {e}");
                return 2;
            }
        };
        if opts.registry.is_none() {
            config.oci_registry.clear();
        }
        if let Err(e) = self.create_demo_pods(opts.pods) {
            eprintln!("vk-cocoon-sandbox: {e}");
            return 1;
        }
        println!("{}", self.banner(opts));
        let status = crate::daemon::run(config);
        self.api.stop();
        // The daemon leaves VMs running on purpose (a restart re-adopts them); the sandbox's
        // fake VMs are processes of this run and must not outlive it.
        let stopped = self.remove_vms();
        println!(
            "\nvk-cocoon-sandbox stopped ({stopped} fake VMs removed). Its files stay in {dir};\n\
             remove them with: rm -r {dir}",
            dir = self.dir.display()
        );
        std::thread::sleep(Duration::from_millis(50));
        status
    }

    /// What to run against the sandbox, printed once it is up.
    pub fn banner(&self, opts: &SandboxOptions) -> String {
        let k = format!("kubectl --kubeconfig {}", self.kubeconfig.display());
        let clone_pod = if opts.pods > 0 { "demo-0" } else { "POD" };
        format!(
            "\nvk-cocoon-sandbox is up (files in {dir})\n\
             \n  {k} get nodes,pods -o wide\
             \n  {k} logs {clone_pod}\
             \n  {k} exec {clone_pod} -- uname -a\
             \n  {k} port-forward {clone_pod} 8022:22   (reaches what listens on the pod's loopback IP)\
             \n  {k} top pod        (the first answer takes a few seconds)\
             \n  {k} top node\
             \n  {k} get events\
             \n  {k} delete pod {clone_pod}\
             \n  curl -s http://{metrics}/metrics | grep vk_cocoon_\
             \n  FAKE_COCOON_STATE={state} {cocoon} vm list -o json\
             \n  (a managed pod with cocoonset.cocoonstack.io/os=macos runs on the fake cocoon-macos)\
             \n\nMake your own pod (the annotations are the pod contract; see README.md):\
             \n  {k} apply -f {examples}/clone-pod.yaml\
             \n  {k} apply -f {examples}/run-pod.yaml\
             \n\nCtrl-C stops the daemon and removes the fake VMs.\n",
            dir = self.dir.display(),
            examples = self.dir.join("examples").display(),
            metrics = opts.metrics_addr,
            state = self.state.display(),
            cocoon = self.cocoon.display(),
        )
    }

    /// Removes every VM the fake cocoon knows; returns how many went.
    fn remove_vms(&self) -> usize {
        let cocoon = |args: &[&str]| {
            std::process::Command::new(&self.cocoon)
                .args(args)
                .env("FAKE_COCOON_STATE", &self.state)
                .env("COCOON_ROOT_DIR", self.dir.join("root"))
                .output()
        };
        let listed = match cocoon(&["vm", "list", "-o", "json"]) {
            Ok(out) if out.status.success() => out.stdout,
            Ok(out) => {
                eprintln!(
                    "vk-cocoon-sandbox: listing fake VMs: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                return 0;
            }
            Err(e) => {
                eprintln!("vk-cocoon-sandbox: listing fake VMs: {e}");
                return 0;
            }
        };
        let ids: Vec<String> = serde_json::from_slice::<Vec<serde_json::Value>>(&listed)
            .unwrap_or_default()
            .iter()
            .filter_map(|vm| vm["id"].as_str().map(str::to_string))
            .collect();
        let cocoon_vms = ids
            .iter()
            .filter(|id| {
                matches!(cocoon(&["vm", "rm", "--force", id.as_str()]), Ok(out) if out.status.success())
            })
            .count();
        cocoon_vms + self.remove_macos_guests()
    }

    /// Removes every guest of the fake cocoon-macos (their QEMU `sleep`s with them).
    fn remove_macos_guests(&self) -> usize {
        fake_cocoon_macos::records(&self.macos_state)
            .iter()
            .filter(|r| {
                std::process::Command::new(&self.cocoon_macos)
                    .args(["vm", "rm", r.name.as_str()])
                    .env("FAKE_COCOON_MACOS_STATE", &self.macos_state)
                    .output()
                    .is_ok_and(|out| out.status.success())
            })
            .count()
    }
}

/// A pod as cocoon-operator writes it, bound to the sandbox node.
pub fn demo_pod(namespace: &str, name: &str, mode: &str, image: &str) -> Pod {
    let value = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": {
                "vm.cocoonstack.io/name": format!("vk-{namespace}-{name}"),
                "cocoonset.cocoonstack.io/image": image,
                "cocoonset.cocoonstack.io/mode": mode,
                "cocoonset.cocoonstack.io/managed": "true",
                "cocoonset.cocoonstack.io/snapshot-policy": "never"
            }
        },
        "spec": {
            "nodeName": "cocoon-sandbox",
            "containers": [{
                "name": "agent",
                "image": image,
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2"}}
            }],
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}]
        }
    });
    serde_json::from_value(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_parse_and_reject_unknown_flags() {
        let o = parse_args(&[
            "--pods".into(),
            "5".into(),
            "--api-port".into(),
            "6443".into(),
        ])
        .unwrap();
        assert_eq!((o.pods, o.api_port), (5, 6443));
        assert!(parse_args(&["--pods".into(), "many".into()]).is_err());
        assert!(parse_args(&["--bogus".into()]).is_err());
        assert!(parse_args(&["--dir".into()]).is_err());
    }

    #[test]
    fn demo_pods_carry_the_operator_annotations() {
        let pod = demo_pod("default", "demo-0", "clone", "demo-base");
        let a = pod.metadata.annotations.unwrap_or_default();
        assert_eq!(a["vm.cocoonstack.io/name"], "vk-default-demo-0");
        assert_eq!(
            pod.spec.and_then(|s| s.node_name).as_deref(),
            Some("cocoon-sandbox")
        );
    }
}
