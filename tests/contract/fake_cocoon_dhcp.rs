//! The fake cocoon's DHCP mode: NICs carry no static address and cocoon-net's lease file follows the
//! running VMs (rows appear on start, go on rm / vanish / stop) and parses with `LeaseFile`.

use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};
use vk_cocoon::network::leases::LeaseFile;
use vk_cocoon::sandbox::fake_cocoon;
use vk_cocoon::vm::*;

struct Fake {
    dir: tempfile::TempDir,
    bin: PathBuf,
}

impl Fake {
    fn new() -> Fake {
        Fake {
            dir: tempfile::tempdir().expect("tempdir"),
            bin: PathBuf::from(env!("CARGO_BIN_EXE_vk-cocoon-sandbox")),
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn leases(&self) -> PathBuf {
        self.dir.path().join("net/leases.json")
    }

    /// Runs the fake; `dhcp_env` false leaves the env out (the mode must be remembered).
    fn call(&self, argv: Vec<String>, dhcp_env: bool) -> (CocoonCall, CallOutcome) {
        let verb = Verb::of_argv(&argv).expect("known verb");
        let call = CocoonCall::new(verb, argv, &Deadlines::default());
        let mut c = Command::new(&self.bin);
        c.arg("fake-cocoon")
            .args(&call.argv)
            .env("FAKE_COCOON_STATE", self.state())
            .env_remove("FAKE_COCOON_DHCP")
            .env_remove("FAKE_COCOON_LEASES");
        if dhcp_env {
            c.env("FAKE_COCOON_DHCP", "1")
                .env("FAKE_COCOON_LEASES", self.leases());
        }
        let out = c.output().expect("run fake");
        let outcome = CallOutcome {
            exit: ExitKind::Code(out.status.code().unwrap_or(-1)),
            stdout: out.stdout,
            stderr: out.stderr,
            stdout_truncated: false,
            stderr_truncated: false,
            timed_out: false,
        };
        (call, outcome)
    }

    fn ok(&self, argv: Vec<String>) {
        let (call, out) = self.call(argv, true);
        call.check(&out).expect("call succeeds");
    }

    fn clone_vm(&self, name: &str, nics: u32, dhcp_env: bool) -> Vm {
        let mut o = CloneOptions::from_snapshot("base");
        o.name = name.into();
        o.nics = Some(nics);
        let (call, out) = self.call(argv::vm_clone(&o), dhcp_env);
        parse_vm(&call, &out).expect("clone output parses")
    }

    fn seed(&self) {
        self.ok(argv::image_pull("ghcr.io/example/ubuntu:24.04", false));
        self.ok(argv::vm_run(&RunOptions {
            image: "ghcr.io/example/ubuntu:24.04".into(),
            name: "seed".into(),
            cpu: 1,
            memory: "1073741824".into(),
            ..Default::default()
        }));
        self.ok(argv::snapshot_save("base", "seed"));
    }

    /// The raw rows: (mac, ip, expiry).
    fn rows(&self) -> Vec<(String, String, String)> {
        let text = std::fs::read_to_string(self.leases()).expect("lease file exists");
        let v: Vec<serde_json::Value> = serde_json::from_str(&text).expect("a JSON array");
        v.iter()
            .map(|r| {
                let obj = r.as_object().expect("row is an object");
                assert_eq!(obj.len(), 3, "exactly mac, ip, expiry: {r}");
                (
                    obj["mac"].as_str().unwrap().to_string(),
                    obj["ip"].as_str().unwrap().to_string(),
                    obj["expiry"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }
}

fn lookup(path: &Path, mac: &str) -> Option<Ipv4Addr> {
    LeaseFile::new(path)
        .lookup(mac, SystemTime::now())
        .expect("lease file parses")
        .map(|l| l.ip)
}

fn in_fake_range(ip: Ipv4Addr) -> bool {
    ip.octets()[0] == 127 && ip.octets()[1] == 88
}

#[test]
fn dhcp_nics_have_no_static_address_and_leases_follow_running_vms() {
    let f = Fake::new();
    f.seed();
    let vm = f.clone_vm("vk-ns-a-0", 2, true);
    assert_eq!(vm.network_configs.len(), 2);
    assert!(
        vm.network_configs.iter().all(|n| n.network.is_none()),
        "DHCP NICs carry no static address: {:?}",
        vm.network_configs
    );
    assert_eq!(vm.primary_ip(), None);

    // One row per NIC of each running VM (the seed VM has one NIC), lower-case MACs.
    let rows = f.rows();
    assert_eq!(rows.len(), 3, "{rows:?}");
    let meta = std::fs::metadata(f.leases()).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o644);
    for nic in &vm.network_configs {
        let mac = nic.mac.to_ascii_lowercase();
        assert!(rows.iter().any(|r| r.0 == mac), "{mac} leased");
        let ip = lookup(&f.leases(), &nic.mac.to_ascii_uppercase()).expect("lease present");
        assert!(in_fake_range(ip), "{ip} is loopback 127.88/16");
    }
    // Expiry is about an hour ahead: a lookup one hour and a minute on finds nothing.
    let mac0 = vm.network_configs[0].mac.clone();
    let later = SystemTime::now() + Duration::from_secs(3660);
    assert!(LeaseFile::new(f.leases())
        .lookup(&mac0, later)
        .unwrap()
        .is_none());
    assert!(LeaseFile::new(f.leases())
        .lookup(&mac0, SystemTime::now() + Duration::from_secs(3500))
        .unwrap()
        .is_some());
    let ips: std::collections::BTreeSet<&String> = rows.iter().map(|r| &r.1).collect();
    assert_eq!(ips.len(), rows.len(), "distinct IPs");

    // A later invocation without the env keeps DHCP mode and the existing leases' IPs.
    let ip0 = lookup(&f.leases(), &mac0);
    let other = f.clone_vm("vk-ns-b-0", 1, false);
    assert!(
        other.network_configs[0].network.is_none(),
        "mode remembered"
    );
    assert_eq!(lookup(&f.leases(), &mac0), ip0, "IP is stable");
    assert!(lookup(&f.leases(), &other.network_configs[0].mac).is_some());

    // rm drops the removed VM's rows only.
    f.ok(argv::vm_rm(&vm.id));
    for nic in &vm.network_configs {
        assert_eq!(lookup(&f.leases(), &nic.mac), None, "lease released on rm");
    }
    assert!(lookup(&f.leases(), &other.network_configs[0].mac).is_some());

    // A vanished VM (library helper, no env) loses its lease too.
    fake_cocoon::vanish_vm(&f.state(), &other.id).expect("vanish");
    assert_eq!(lookup(&f.leases(), &other.network_configs[0].mac), None);
    assert_eq!(f.rows().len(), 1, "only the seed VM is left");

    // A VM that stops on its own loses its lease.
    fake_cocoon::stop_vm(&f.state(), "seed", false).expect("stop");
    assert!(f.rows().is_empty());
}

#[test]
fn rows_of_another_writer_outside_the_fakes_range_stay() {
    let f = Fake::new();
    f.seed();
    let foreign =
        r#"[{"mac":"02:00:4d:ac:00:01","ip":"127.89.0.1","expiry":"2099-01-01T00:00:00Z"}]"#;
    std::fs::write(f.leases(), foreign).unwrap();
    let vm = f.clone_vm("vk-ns-a-0", 1, true);
    let rows = f.rows();
    assert!(
        rows.iter()
            .any(|r| r.0 == "02:00:4d:ac:00:01" && r.1 == "127.89.0.1"),
        "{rows:?}"
    );
    let mac = vm.network_configs[0].mac.to_ascii_lowercase();
    assert!(rows.iter().any(|r| r.0 == mac), "{rows:?}");
    // The fake's own rows still follow its VMs: removing the VM drops only its row.
    f.ok(argv::vm_rm(&vm.id));
    let rows = f.rows();
    assert!(!rows.iter().any(|r| r.0 == mac), "{rows:?}");
    assert!(rows.iter().any(|r| r.1 == "127.89.0.1"), "{rows:?}");
}

#[test]
fn static_mode_is_unchanged_and_writes_no_lease_file() {
    let f = Fake::new();
    let (call, out) = f.call(
        argv::image_pull("ghcr.io/example/ubuntu:24.04", false),
        false,
    );
    call.check(&out).expect("pull");
    let (call, out) = f.call(
        argv::vm_run(&RunOptions {
            image: "ghcr.io/example/ubuntu:24.04".into(),
            name: "plain".into(),
            cpu: 1,
            memory: "1073741824".into(),
            ..Default::default()
        }),
        false,
    );
    let vm = parse_vm(&call, &out).expect("run parses");
    let ip = vm.primary_ip().expect("static address");
    assert!(in_fake_range(ip.parse().unwrap()));
    assert!(!f.leases().exists());
}

#[test]
fn dhcp_without_lease_path_is_a_clear_error() {
    let f = Fake::new();
    let out = Command::new(&f.bin)
        .args(["fake-cocoon", "vm", "list", "-o", "json"])
        .env("FAKE_COCOON_STATE", f.state())
        .env("FAKE_COCOON_DHCP", "1")
        .env_remove("FAKE_COCOON_LEASES")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("FAKE_COCOON_LEASES"));
}
