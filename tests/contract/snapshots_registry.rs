//! Snapshot and cloud-image transfers through a real `docker-registry` (distribution) on
//! loopback, with a test stand-in for the cocoon CLI. Skips with a reason when the binary is absent.

use crate::registry_support;

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use registry_support::{Registry, REGISTRY_BIN};
use sha2::{Digest, Sha256};
use vk_cocoon::snapshots::auth::AuthSettings;
use vk_cocoon::snapshots::client::{sha256_digest, Body};
use vk_cocoon::snapshots::tarstream::{TarReader, TarWriter};
use vk_cocoon::snapshots::{
    manifest_info, pull_cloud_image, pull_snapshot, push_snapshot, ArtifactKind, CloudImageRequest,
    PullRequest, PushKnobs, PushRequest, RegistryBase, RegistryClient, RetryPolicy, TransferError,
};

const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------- harness

/// A registry for one test; `htpasswd` = (user, password) enables basic auth. `None` = skip
/// (with the reason) when docker-registry or htpasswd is not installed.
fn start_registry(htpasswd: Option<(&str, &str)>) -> Option<Registry> {
    if !Registry::available() {
        eprintln!("SKIP: {REGISTRY_BIN} missing (apt-get install docker-registry)");
        return None;
    }
    let entries = match htpasswd {
        None => None,
        Some((user, pass)) => match Command::new("htpasswd").args(["-Bbn", user, pass]).output() {
            Ok(o) if o.status.success() => Some(o.stdout),
            _ => {
                eprintln!("SKIP: htpasswd missing (apt-get install apache2-utils)");
                return None;
            }
        },
    };
    Some(Registry::start(None, entries.as_deref()))
}

fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        delays: vec![Duration::from_millis(20), Duration::from_millis(60)],
    }
}

fn client_for(host: &str, auth: AuthSettings) -> RegistryClient {
    RegistryClient::new(RegistryBase::parse(host).expect("base"), auth, fast_retry())
}

/// The project's fake cocoon (`vk-cocoon` behind a `cocoon` symlink, the same binary and CLI
/// contract the daemon tests use) with a state directory of its own beside the symlink, so
/// parallel tests never share snapshots. Snapshots are seeded with `snapshot import` from a
/// synthetic archive and read back with `snapshot export`.
struct FakeCocoon {
    dir: tempfile::TempDir,
}

const FAKE_COCOON: &str = env!("CARGO_BIN_EXE_vk-cocoon-sandbox");

impl FakeCocoon {
    fn new() -> FakeCocoon {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(dir.path().join("bin/fake-cocoon-state")).expect("state dir");
        std::os::unix::fs::symlink(FAKE_COCOON, dir.path().join("bin/cocoon")).expect("symlink");
        FakeCocoon { dir }
    }
    fn bin(&self) -> PathBuf {
        self.dir.path().join("bin/cocoon")
    }
    fn state(&self) -> PathBuf {
        self.dir.path().join("bin/fake-cocoon-state")
    }
    fn cocoon(&self, args: &[&str]) -> std::process::Output {
        Command::new(self.bin())
            .args(args)
            .env_remove("FAKE_COCOON_STATE")
            .env_remove("COCOON_ROOT_DIR")
            .output()
            .expect("run fake cocoon")
    }
    /// Where the synthetic archive of snapshot `name` is written before it is seeded.
    fn export_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("export-{name}.tar"))
    }
    /// Writes a synthetic archive and imports it into the fake as snapshot `name`.
    fn create_snapshot(&self, name: &str, files: &[FileSpec]) {
        let path = self.export_path(name);
        write_export(&path, "SEED", files);
        let out = Command::new(self.bin())
            .args(["snapshot", "import", "--name", name])
            .stdin(fs::File::open(&path).expect("open archive"))
            .output()
            .expect("seed snapshot");
        assert!(
            out.status.success(),
            "seeding {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    /// The fake's snapshot ID of `name` (the `SnapshotID` a push records).
    fn snapshot_id(&self, name: &str) -> String {
        let out = self.cocoon(&["snapshot", "inspect", name]);
        assert!(out.status.success(), "inspect {name}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("inspect json");
        v["id"].as_str().expect("id").to_string()
    }
    /// `snapshot export NAME` of what an import left in the fake, as a file; a path that does
    /// not exist when there is no such snapshot.
    fn import_path(&self, name: &str) -> PathBuf {
        let path = self.dir.path().join(format!("import-{name}.tar"));
        let _ = fs::remove_file(&path);
        let out = self.cocoon(&["snapshot", "export", name, "-o", &path.to_string_lossy()]);
        if !out.status.success() {
            let _ = fs::remove_file(&path);
        }
        path
    }
    /// `image inspect NAME` as JSON, `None` when the fake has no such image.
    fn image(&self, name: &str) -> Option<serde_json::Value> {
        let out = self.cocoon(&["image", "inspect", name]);
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }
    /// Names of the fake's snapshots.
    fn snapshot_names(&self) -> Vec<String> {
        let out = self.cocoon(&["snapshot", "list", "-o", "json"]);
        assert!(out.status.success(), "snapshot list");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("list json");
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s["name"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }
    fn set_faults(&self, json: &str) {
        fs::write(self.state().join("faults.json"), json).expect("faults");
    }
    /// `.import-*` staging directories in the fake's state (debris of an unfinished import).
    fn import_staging(&self) -> Vec<String> {
        fs::read_dir(self.state().join("snapshots"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(".import-"))
                    .collect()
            })
            .unwrap_or_default()
    }
    /// Runs one ordinary cocoon command and asserts no import staging survived it.
    fn assert_no_import_debris(&self) {
        assert!(self.cocoon(&["snapshot", "list"]).status.success());
        let left = self.import_staging();
        assert!(left.is_empty(), "import staging left behind: {left:?}");
    }
}

/// One file of a synthetic export.
struct FileSpec {
    name: &'static str,
    size: u64,
    mode: u32,
    sparse: Option<(String, u64)>,
    seed: u64,
}

/// Deterministic body: alternating 1 MiB stretches of pseudo-random bytes and a repeated
/// pattern, so zstd has something to do but the data is not trivially compressible.
fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    let mut x = seed ^ 0x9E37_79B9_7F4A_7C15 ^ offset.wrapping_mul(0x2545_F491_4F6C_DD1D);
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let pos = offset + (i as u64) * 8;
        if (pos / MIB).is_multiple_of(2) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = x.to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        } else {
            for (j, c) in chunk.iter_mut().enumerate() {
                *c = ((pos as usize + j) % 251) as u8;
            }
        }
    }
}

fn write_export(path: &Path, snapshot_id: &str, files: &[FileSpec]) {
    let f = fs::File::create(path).expect("create export");
    let mut w = TarWriter::new(std::io::BufWriter::with_capacity(1 << 20, f));
    let env = format!(
        "{{\n  \"version\": 1,\n  \"config\": {{\n    \"id\": \"{snapshot_id}\",\n    \"name\": \"src\",\n    \"image\": \"ghcr.io/cocoonstack/cocoon/ubuntu:24.04\",\n    \"hypervisor\": \"cloud-hypervisor\",\n    \"cpu\": 2,\n    \"memory\": 4294967296,\n    \"storage\": 10737418240,\n    \"nics\": 1,\n    \"network\": \"cocoon0\",\n    \"queue_size\": 256\n  }}\n}}\n"
    );
    w.begin_entry("snapshot.json", env.len() as u64, 0o644, 1_700_000_000, &[])
        .unwrap();
    w.write_body(env.as_bytes()).unwrap();
    w.end_entry().unwrap();
    let mut buf = vec![0u8; MIB as usize];
    for spec in files {
        let pax: Vec<(String, String)> = match &spec.sparse {
            Some((map, size)) => vec![
                ("COCOON.sparse.map".into(), map.clone()),
                ("COCOON.sparse.size".into(), size.to_string()),
            ],
            None => vec![],
        };
        w.begin_entry(spec.name, spec.size, spec.mode, 1_700_000_000, &pax)
            .unwrap();
        let mut off = 0;
        while off < spec.size {
            let n = (spec.size - off).min(MIB) as usize;
            fill(spec.seed, off, &mut buf[..n]);
            w.write_body(&buf[..n]).unwrap();
            off += n as u64;
        }
        w.end_entry().unwrap();
    }
    w.finish().unwrap();
}

/// (name, size, mode, pax, sha256 of body) of every member except snapshot.json, plus the
/// parsed snapshot.json.
type Member = (String, u64, u32, BTreeMap<String, String>, String);

fn read_members(path: &Path) -> (serde_json::Value, Vec<Member>) {
    let mut r = TarReader::new(std::io::BufReader::new(
        fs::File::open(path).expect("open tar"),
    ));
    let mut env = serde_json::Value::Null;
    let mut out = Vec::new();
    let mut buf = vec![0u8; MIB as usize];
    let mut first = true;
    while let Some(e) = r.next_entry().expect("tar entry") {
        if e.name == "snapshot.json" {
            assert!(first, "snapshot.json must be the first entry");
            let mut body = Vec::new();
            r.body().read_to_end(&mut body).unwrap();
            env = serde_json::from_slice(&body).expect("snapshot.json parses");
            first = false;
            continue;
        }
        first = false;
        let mut h = Sha256::new();
        loop {
            let n = r.read_body(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        out.push((
            e.name.clone(),
            e.size,
            e.mode,
            e.pax.clone(),
            format!("{:x}", h.finalize()),
        ));
    }
    (env, out)
}

fn assert_same_snapshot(export: &Path, import: &Path, local_name: &str) {
    // The fake exports data files in name order; compare by name.
    let (_, mut want) = read_members(export);
    let (env, mut got) = read_members(import);
    want.sort();
    got.sort();
    assert_eq!(env["version"], 1);
    assert_eq!(env["config"]["name"], local_name);
    assert_eq!(env["config"]["hypervisor"], "cloud-hypervisor");
    assert_eq!(want.len(), got.len(), "member count");
    for (w, g) in want.iter().zip(got.iter()) {
        assert_eq!(w, g, "member {} differs", w.0);
    }
    // GNU tar must also accept what cocoon will be fed.
    if let Ok(out) = Command::new("tar").arg("-tf").arg(import).output() {
        assert!(
            out.status.success(),
            "tar -tf rejected the import tar: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let names = String::from_utf8_lossy(&out.stdout);
        assert_eq!(names.lines().next(), Some("snapshot.json"));
    }
}

fn big_files() -> Vec<FileSpec> {
    vec![
        FileSpec {
            name: "config.json",
            size: 4120,
            mode: 0o640,
            sparse: None,
            seed: 1,
        },
        FileSpec {
            name: "state.json",
            size: 88211,
            mode: 0o640,
            sparse: None,
            seed: 2,
        },
        FileSpec {
            name: "memory-ranges",
            size: 128 * MIB,
            mode: 0o600,
            sparse: Some((
                format!(
                    "[{{\"o\":0,\"l\":{}}},{{\"o\":{},\"l\":{}}}]",
                    64 * MIB,
                    512 * MIB,
                    64 * MIB
                ),
                1 << 30,
            )),
            seed: 3,
        },
        FileSpec {
            name: "overlay.qcow2",
            size: 96 * MIB + 12345,
            mode: 0o640,
            sparse: None,
            seed: 4,
        },
        FileSpec {
            name: "cidata.img",
            size: 372736,
            mode: 0o640,
            sparse: None,
            seed: 5,
        },
        FileSpec {
            name: "cocoon.json",
            size: 300,
            mode: 0o644,
            sparse: None,
            seed: 6,
        },
    ]
}

fn small_files() -> Vec<FileSpec> {
    vec![
        FileSpec {
            name: "config.json",
            size: 4120,
            mode: 0o640,
            sparse: None,
            seed: 11,
        },
        FileSpec {
            name: "memory-ranges",
            size: 3 * MIB + 7,
            mode: 0o600,
            sparse: Some(("[{\"o\":0,\"l\":3145735}]".into(), 8 * MIB)),
            seed: 12,
        },
        FileSpec {
            name: "cow.raw",
            size: 2 * MIB,
            mode: 0o640,
            sparse: None,
            seed: 13,
        },
    ]
}

fn push_req(cocoon: &FakeCocoon, name: &str, tag: &str, knobs: PushKnobs) -> PushRequest {
    PushRequest {
        name: name.into(),
        tag: tag.into(),
        cocoon_bin: cocoon.bin(),
        base_image: Some("ghcr.io/cocoonstack/cocoon/ubuntu:24.04".into()),
        from_node: Some("node-a".into()),
        annotations: BTreeMap::new(),
        knobs,
        temp_dir: Some(cocoon.dir.path().to_path_buf()),
    }
}

fn pull_req(cocoon: &FakeCocoon, repo: &str, tag: &str, local: &str) -> PullRequest {
    PullRequest {
        repo: repo.into(),
        tag: tag.into(),
        local_name: local.into(),
        cocoon_bin: cocoon.bin(),
        concurrency: 8,
        budget: 2048 * MIB,
    }
}

fn skopeo_raw(host: &str, repo: &str, tag: &str) -> Option<Vec<u8>> {
    let out = Command::new("skopeo")
        .args([
            "inspect",
            "--raw",
            "--tls-verify=false",
            &format!("docker://{host}/{repo}:{tag}"),
        ])
        .output()
        .ok()?;
    assert!(
        out.status.success(),
        "skopeo inspect failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(out.stdout)
}

fn no_spool_files_left(dir: &Path) {
    let left: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("cocoon-snapshot-")
        })
        .collect();
    assert!(left.is_empty(), "spool files left behind: {left:?}");
}

// ---------------------------------------------------------------- round trips

#[test]
fn v1_round_trip_through_registry_is_byte_identical() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    cocoon.create_snapshot("vm-one", &big_files());
    let client = client_for(&reg.host(), AuthSettings::default());
    let report = push_snapshot(
        &client,
        &push_req(&cocoon, "vm-one", "hibernate", PushKnobs::default()),
    )
    .expect("push");
    assert!(!report.v2);
    assert_eq!(report.layers, 6);
    no_spool_files_left(cocoon.dir.path());

    let info = manifest_info(&client, "vm-one", "hibernate")
        .expect("info")
        .expect("present");
    assert_eq!(info.kind, ArtifactKind::SnapshotV1);
    let id = cocoon.snapshot_id("vm-one");
    assert_eq!(info.snapshot_id.as_deref(), Some(id.as_str()));
    assert_eq!(
        info.base_image(),
        Some("ghcr.io/cocoonstack/cocoon/ubuntu:24.04")
    );
    assert_eq!(info.from_node(), Some("node-a"));
    assert_eq!(info.digest, report.manifest_digest);
    let cfg = info.config.expect("config");
    assert_eq!(cfg.schema_version, "v1");
    assert_eq!(cfg.files["memory-ranges"].sparse_size, 1 << 30);
    assert_eq!(cfg.files["memory-ranges"].mode, 0o600);
    assert_eq!(
        cfg.files["memory-ranges"].size, 0,
        "the v1 writer never records size"
    );

    if let Some(raw) = skopeo_raw(&reg.host(), "vm-one", "hibernate") {
        assert_eq!(
            sha256_digest(&raw),
            report.manifest_digest,
            "skopeo reads the exact manifest we pushed"
        );
        let v: serde_json::Value = serde_json::from_slice(&raw).unwrap();
        assert_eq!(
            v["artifactType"],
            "application/vnd.cocoonstack.snapshot.v1+json"
        );
        // The fake exports its data files in name order; each keeps its media type.
        let by_title = |t: &str| {
            v["layers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["annotations"]["org.opencontainers.image.title"] == t)
                .unwrap_or_else(|| panic!("no layer titled {t}"))
                .clone()
        };
        assert_eq!(
            by_title("memory-ranges")["mediaType"],
            "application/vnd.cocoonstack.vm.memory"
        );
        assert_eq!(
            by_title("cocoon.json")["mediaType"],
            "application/octet-stream"
        );
    } else {
        eprintln!(
            "note: skopeo missing, read-back through skopeo skipped (apt-get install skopeo)"
        );
    }

    let pulled = pull_snapshot(
        &client,
        &pull_req(&cocoon, "vm-one", "hibernate", "vm-one-hibernate-import"),
    )
    .expect("pull");
    assert_eq!(pulled.snapshot_id, id);
    assert_same_snapshot(
        &cocoon.export_path("vm-one"),
        &cocoon.import_path("vm-one-hibernate-import"),
        "vm-one-hibernate-import",
    );
}

#[test]
fn v2_chunked_zstd_sparse_round_trip_parallel_and_sequential() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    cocoon.create_snapshot("vm-two", &big_files());
    let client = client_for(&reg.host(), AuthSettings::default());
    let knobs = PushKnobs {
        zstd_level: 3,
        chunk_size: 8 * MIB,
        concurrency: 4,
        memory_budget: 256 * MIB,
    };
    let report =
        push_snapshot(&client, &push_req(&cocoon, "vm-two", "latest", knobs)).expect("push");
    assert!(report.v2);
    no_spool_files_left(cocoon.dir.path());

    let info = manifest_info(&client, "vm-two", "latest")
        .expect("info")
        .expect("present");
    assert_eq!(info.kind, ArtifactKind::SnapshotV2);
    let cfg = info.config.expect("config");
    assert_eq!(cfg.schema_version, "v2");
    let mem = &cfg.files["memory-ranges"];
    assert_eq!(mem.size, (128 * MIB) as i64);
    assert_eq!(mem.chunks.len(), 16);
    assert_eq!(cfg.files["overlay.qcow2"].chunks.len(), 13);
    assert!(cfg.files["state.json"].chunks.is_empty());
    assert_eq!(
        cfg.files["state.json"].size, 88211,
        "the v2 writer records size for every file"
    );
    let (body, _) = client
        .get_manifest(&client.reference("vm-two", "latest").unwrap())
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let layers = v["layers"].as_array().unwrap();
    let mem_layers: Vec<_> = layers
        .iter()
        .filter(|l| l["annotations"]["org.opencontainers.image.title"] == "memory-ranges")
        .collect();
    assert_eq!(mem_layers.len(), 16);
    for (i, l) in mem_layers.iter().enumerate() {
        assert_eq!(l["mediaType"], "application/vnd.cocoonstack.vm.memory+zstd");
        assert_eq!(l["annotations"]["cocoonstack.chunk.index"], i.to_string());
        assert_eq!(l["annotations"]["cocoonstack.chunk.count"], "16");
        assert_eq!(l["digest"], mem.chunks[i]);
    }
    let compressed: u64 = mem_layers.iter().map(|l| l["size"].as_u64().unwrap()).sum();
    assert!(
        compressed < 100 * MIB,
        "half of the memory body is a repeated pattern: {compressed}"
    );
    if let Some(raw) = skopeo_raw(&reg.host(), "vm-two", "latest") {
        assert_eq!(sha256_digest(&raw), report.manifest_digest);
    }

    // Parallel window (default budget) and sequential (budget below one chunk) both rebuild it.
    pull_snapshot(&client, &pull_req(&cocoon, "vm-two", "latest", "par")).expect("parallel pull");
    assert_same_snapshot(
        &cocoon.export_path("vm-two"),
        &cocoon.import_path("par"),
        "par",
    );
    let mut seq = pull_req(&cocoon, "vm-two", "", "seq");
    seq.budget = MIB;
    pull_snapshot(&client, &seq).expect("sequential pull");
    assert_same_snapshot(
        &cocoon.export_path("vm-two"),
        &cocoon.import_path("seq"),
        "seq",
    );
}

#[test]
fn zstd_without_chunking_streams_one_frame_per_file() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    cocoon.create_snapshot("vm-z", &small_files());
    let client = client_for(&reg.host(), AuthSettings::default());
    let knobs = PushKnobs {
        zstd_level: 1,
        ..PushKnobs::default()
    };
    let report = push_snapshot(&client, &push_req(&cocoon, "vm-z", "latest", knobs)).expect("push");
    assert!(report.v2);
    let (body, _) = client
        .get_manifest(&client.reference("vm-z", "latest").unwrap())
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let types: Vec<&str> = v["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["mediaType"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "application/vnd.cocoonstack.vm.config+json",
            "application/vnd.cocoonstack.disk.raw+zstd",
            "application/vnd.cocoonstack.vm.memory+zstd"
        ]
    );
    pull_snapshot(&client, &pull_req(&cocoon, "vm-z", "latest", "z")).expect("pull");
    assert_same_snapshot(&cocoon.export_path("vm-z"), &cocoon.import_path("z"), "z");
}

// ---------------------------------------------------------------- bad input

#[test]
fn corrupted_blob_in_registry_storage_is_detected_and_nothing_imported() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    cocoon.create_snapshot("vm-c", &small_files());
    let client = client_for(&reg.host(), AuthSettings::default());
    push_snapshot(
        &client,
        &push_req(&cocoon, "vm-c", "latest", PushKnobs::default()),
    )
    .expect("push");
    let info = manifest_info(&client, "vm-c", "latest").unwrap().unwrap();
    let (body, _) = client
        .get_manifest(&client.reference("vm-c", "latest").unwrap())
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let digest = v["layers"][2]["digest"].as_str().unwrap().to_string();
    assert!(info.digest.starts_with("sha256:"));
    // Flip one byte near the end of the last layer's stored data.
    let path = reg.blob_data_path(&digest);
    let mut data = fs::read(&path).expect("blob data in storage");
    let at = data.len() - 10;
    data[at] ^= 0x55;
    fs::write(&path, &data).unwrap();

    let err = pull_snapshot(&client, &pull_req(&cocoon, "vm-c", "latest", "bad"))
        .expect_err("corruption must fail");
    assert!(matches!(err, TransferError::Integrity(_)), "{err:?}");
    assert!(
        err.to_string().contains(&digest),
        "error names the digest: {err}"
    );
    assert!(
        err.to_string().contains("vm-c"),
        "error names the reference: {err}"
    );
    assert!(!cocoon.import_path("bad").exists(), "nothing imported");
    assert!(
        !cocoon.snapshot_names().contains(&"bad".to_string()),
        "no snapshot registered under the local name"
    );
    // The killed import's staging directory is swept by the next cocoon command.
    cocoon.assert_no_import_debris();
}

#[test]
fn truncated_export_stream_publishes_no_tag() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    cocoon.create_snapshot("vm-t", &small_files());
    // cocoon dies 3 MiB into the export stream (inside memory-ranges).
    cocoon.set_faults(&format!(
        "{{\"snapshot export\": {{\"truncate_after\": {}}}}}",
        3 * MIB
    ));
    let client = client_for(&reg.host(), AuthSettings::default());
    let err = push_snapshot(
        &client,
        &push_req(&cocoon, "vm-t", "latest", PushKnobs::default()),
    )
    .expect_err("truncated export");
    assert!(err.to_string().contains("ended early"), "{err}");
    assert!(
        manifest_info(&client, "vm-t", "latest").unwrap().is_none(),
        "no manifest published"
    );
    no_spool_files_left(cocoon.dir.path());
    // Same for the chunked writer.
    let knobs = PushKnobs {
        zstd_level: 3,
        chunk_size: MIB,
        concurrency: 2,
        memory_budget: 64 * MIB,
    };
    assert!(push_snapshot(&client, &push_req(&cocoon, "vm-t", "latest", knobs)).is_err());
    assert!(manifest_info(&client, "vm-t", "latest").unwrap().is_none());
}

#[test]
fn chunk_size_over_budget_is_refused_before_export() {
    let cocoon = FakeCocoon::new();
    let client = client_for("127.0.0.1:1", AuthSettings::default());
    let knobs = PushKnobs {
        zstd_level: 0,
        chunk_size: 64 * MIB,
        concurrency: 8,
        memory_budget: 128 * MIB,
    };
    let err =
        push_snapshot(&client, &push_req(&cocoon, "vm", "latest", knobs)).expect_err("over budget");
    assert!(matches!(err, TransferError::Invalid(_)), "{err:?}");
    assert_eq!(
        fs::read_dir(cocoon.state()).unwrap().count(),
        0,
        "cocoon was not started (its state directory is untouched)"
    );
}

fn put_json_blob(client: &RegistryClient, repo: &str, bytes: &[u8]) -> String {
    let d = sha256_digest(bytes);
    client
        .put_blob(&client.base.repository(repo), &d, Body::Bytes(bytes))
        .expect("put blob");
    d
}

#[test]
fn hand_built_manifest_from_spec_layout_pulls() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    let client = client_for(&reg.host(), AuthSettings::default());
    let bodies: Vec<(&str, &str, Vec<u8>)> = vec![
        (
            "application/vnd.cocoonstack.vm.config+json",
            "config.json",
            b"{\"cpus\":2}".to_vec(),
        ),
        (
            "application/vnd.cocoonstack.vm.state+json",
            "state.json",
            b"{\"state\":1}".to_vec(),
        ),
        (
            "application/vnd.cocoonstack.vm.memory",
            "memory-ranges",
            vec![7u8; 100_000],
        ),
        (
            "application/vnd.cocoonstack.disk.qcow2",
            "overlay.qcow2",
            vec![9u8; 50_000],
        ),
        (
            "application/vnd.cocoonstack.vm.cidata",
            "cidata.img",
            vec![1u8; 4096],
        ),
    ];
    let config = br#"{"schemaVersion":"v1","snapshotId":"01J9Z8K2Q6","image":"ghcr.io/cocoonstack/cocoon/ubuntu:24.04","hypervisor":"cloud-hypervisor","cpu":2,"memory":4294967296,"files":{"config.json":{"mode":416},"memory-ranges":{"mode":384,"sparseMap":"[{\"o\":0,\"l\":100000}]","sparseSize":8388608}},"createdAt":"2026-08-11T07:12:33.481516923Z"}"#;
    let cd = put_json_blob(&client, "hand", config);
    let mut layers = String::new();
    for (i, (mt, title, body)) in bodies.iter().enumerate() {
        let d = put_json_blob(&client, "hand", body);
        layers.push_str(&format!(
            "{}    {{\n      \"mediaType\": \"{mt}\",\n      \"digest\": \"{d}\",\n      \"size\": {},\n      \"annotations\": {{\n        \"org.opencontainers.image.title\": \"{title}\"\n      }}\n    }}",
            if i == 0 { "" } else { ",\n" },
            body.len()
        ));
    }
    let manifest = format!(
        "{{\n  \"schemaVersion\": 2,\n  \"mediaType\": \"application/vnd.oci.image.manifest.v1+json\",\n  \"artifactType\": \"application/vnd.cocoonstack.snapshot.v1+json\",\n  \"config\": {{\n    \"mediaType\": \"application/vnd.cocoonstack.snapshot.config.v1+json\",\n    \"digest\": \"{cd}\",\n    \"size\": {}\n  }},\n  \"layers\": [\n{layers}\n  ],\n  \"annotations\": {{\n    \"cocoonstack.snapshot.baseimage\": \"ghcr.io/cocoonstack/cocoon/ubuntu:24.04\",\n    \"cocoonstack.snapshot.from-node\": \"node-a\",\n    \"org.opencontainers.image.created\": \"2026-08-11T07:12:33Z\"\n  }}\n}}",
        config.len()
    );
    let r = client.reference("hand", "v1").unwrap();
    client
        .put_manifest(
            &r,
            manifest.as_bytes(),
            "application/vnd.oci.image.manifest.v1+json",
        )
        .expect("put manifest");
    let rep = pull_snapshot(&client, &pull_req(&cocoon, "hand", "v1", "hand:v1x"))
        .expect("pull hand-built");
    assert_eq!(rep.snapshot_id, "01J9Z8K2Q6");
    let (env, members) = read_members(&cocoon.import_path("hand:v1x"));
    let id = cocoon.snapshot_id("hand:v1x");
    assert_eq!(
        env["config"]["id"], id,
        "the fake gives an import a fresh ID"
    );
    let names: Vec<&str> = members.iter().map(|m| m.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "cidata.img",
            "config.json",
            "memory-ranges",
            "overlay.qcow2",
            "state.json"
        ]
    );
    let member = |n: &str| members.iter().find(|m| m.0 == n).unwrap().clone();
    assert_eq!(member("config.json").2, 0o640, "mode 416");
    assert_eq!(
        member("state.json").2,
        0o640,
        "absent mode defaults to 0640"
    );
    let mem = member("memory-ranges");
    assert_eq!(mem.2, 0o600);
    assert_eq!(
        mem.3.get("COCOON.sparse.size").map(String::as_str),
        Some("8388608")
    );
    assert_eq!(mem.4, format!("{:x}", Sha256::digest(&bodies[2].2)));

    // A zstd layer under the v1 artifactType is refused before anything is imported.
    let bad = manifest.replace("vm.memory\"", "vm.memory+zstd\"");
    client
        .put_manifest(
            &client.reference("hand", "bad").unwrap(),
            bad.as_bytes(),
            "application/vnd.oci.image.manifest.v1+json",
        )
        .unwrap();
    let err =
        pull_snapshot(&client, &pull_req(&cocoon, "hand", "bad", "hb")).expect_err("zstd in v1");
    assert!(matches!(err, TransferError::Format(_)), "{err:?}");
    assert!(!cocoon.import_path("hb").exists());
    // An unknown layer type needs a newer reader.
    let bad = manifest.replace("disk.qcow2\"", "disk.qcow2.part\"");
    client
        .put_manifest(
            &client.reference("hand", "bad2").unwrap(),
            bad.as_bytes(),
            "application/vnd.oci.image.manifest.v1+json",
        )
        .unwrap();
    let err =
        pull_snapshot(&client, &pull_req(&cocoon, "hand", "bad2", "hb")).expect_err("unknown type");
    assert!(err.to_string().contains("newer reader"), "{err}");

    // Hostile registry content never reaches the import.
    let put = |tag: &str, m: &str| {
        client
            .put_manifest(
                &client.reference("hand", tag).unwrap(),
                m.as_bytes(),
                "application/vnd.oci.image.manifest.v1+json",
            )
            .unwrap();
    };
    let with_config = |cfg: &str| {
        let d = put_json_blob(&client, "hand", cfg.as_bytes());
        manifest.replace(
            &format!("\"digest\": \"{cd}\",\n    \"size\": {}", config.len()),
            &format!("\"digest\": \"{d}\",\n    \"size\": {}", cfg.len()),
        )
    };
    let text = std::str::from_utf8(config).unwrap();
    // A NUL in a layer title would cut the member name short.
    put(
        "nul",
        &manifest.replace("\"state.json\"", "\"state\\u0000.json\""),
    );
    let err = pull_snapshot(&client, &pull_req(&cocoon, "hand", "nul", "hn")).expect_err("NUL");
    assert!(err.to_string().contains("unsafe title"), "{err}");
    assert!(!cocoon.import_path("hn").exists());
    // setuid / setgid / sticky bits are dropped: 0o6755 and 0o1777 become 0o755 and 0o777.
    put(
        "suid",
        &with_config(&text.replace(
            "\"config.json\":{\"mode\":416}",
            "\"config.json\":{\"mode\":3565},\"state.json\":{\"mode\":1023}",
        )),
    );
    pull_snapshot(&client, &pull_req(&cocoon, "hand", "suid", "hs")).expect("pull");
    let (_, members) = read_members(&cocoon.import_path("hs"));
    let mode = |n: &str| members.iter().find(|m| m.0 == n).unwrap().2;
    assert_eq!(mode("config.json"), 0o755);
    assert_eq!(mode("state.json"), 0o777);
    // A snapshotId that is not a plain identifier is refused.
    put(
        "badid",
        &with_config(&text.replace("\"01J9Z8K2Q6\"", "\"--force ../x\"")),
    );
    let err =
        pull_snapshot(&client, &pull_req(&cocoon, "hand", "badid", "hi")).expect_err("bad id");
    assert!(err.to_string().contains("snapshotId"), "{err}");
    assert!(!cocoon.import_path("hi").exists());
}

#[test]
fn cloud_images_pull_into_image_import_and_snapshots_are_refused_for_run() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    let client = client_for(&reg.host(), AuthSettings::default());
    // The fake's `image import` wants a qcow2 (magic `QFI\xfb`) or tar stream.
    let mut part0 = b"QFI\xfb".to_vec();
    part0.resize(300_000, 0x51);
    let part1 = vec![0x52u8; 123_456];
    let sums = b"abc  win.qcow2\n".to_vec();
    let d0 = put_json_blob(&client, "win", &part0);
    let d1 = put_json_blob(&client, "win", &part1);
    let ds = put_json_blob(&client, "win", &sums);
    let empty = put_json_blob(&client, "win", b"{}");
    // Layers listed out of title order: the puller sorts by title.
    let manifest = serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.cocoonstack.os-image.v1+json",
        "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": empty, "size": 2},
        "layers": [
            {"mediaType": "application/vnd.cocoonstack.disk.qcow2.part", "digest": d1, "size": part1.len(), "annotations": {"org.opencontainers.image.title": "win.qcow2.01.qcow2.part"}},
            {"mediaType": "text/plain", "digest": ds, "size": sums.len(), "annotations": {"org.opencontainers.image.title": "SHA256SUMS"}},
            {"mediaType": "application/vnd.cocoonstack.disk.qcow2.part", "digest": d0, "size": part0.len(), "annotations": {"org.opencontainers.image.title": "win.qcow2.00.qcow2.part"}}
        ],
        "annotations": {"cocoonstack.disk.format": "qcow2"}
    });
    client
        .put_manifest(
            &client.reference("win", "11").unwrap(),
            manifest.to_string().as_bytes(),
            "application/vnd.oci.image.manifest.v1+json",
        )
        .unwrap();
    let info = manifest_info(&client, "win", "11").unwrap().unwrap();
    assert_eq!(info.kind, ArtifactKind::CloudImage);
    let req = CloudImageRequest {
        repo: "win".into(),
        tag: "11".into(),
        local_name: "win-11".into(),
        cocoon_bin: cocoon.bin(),
    };
    pull_cloud_image(&client, &req).expect("cloud image pull");
    let img = cocoon.image("win-11").expect("image imported");
    let whole = [part0.clone(), part1.clone()].concat();
    assert_eq!(img["type"], "cloudimg");
    assert_eq!(img["size"], whole.len() as u64);
    assert_eq!(
        img["id"],
        sha256_digest(&whole),
        "parts concatenated in title order"
    );
    // A cloud image is not a snapshot.
    let err =
        pull_snapshot(&client, &pull_req(&cocoon, "win", "11", "w")).expect_err("not a snapshot");
    assert!(err.to_string().contains("not a snapshot"), "{err}");

    // A snapshot given to mode=run.
    cocoon.create_snapshot("snapvm", &small_files());
    push_snapshot(
        &client,
        &push_req(&cocoon, "snapvm", "latest", PushKnobs::default()),
    )
    .unwrap();
    let req = CloudImageRequest {
        repo: "snapvm".into(),
        tag: "latest".into(),
        local_name: "x".into(),
        cocoon_bin: cocoon.bin(),
    };
    let err = pull_cloud_image(&client, &req).expect_err("snapshot for run");
    assert!(
        err.to_string()
            .contains("is a snapshot artifact; use mode=clone instead of mode=run"),
        "{err}"
    );

    // A corrupt part imports nothing.
    let path = reg.blob_data_path(&d1);
    let mut data = fs::read(&path).unwrap();
    data[5] ^= 1;
    fs::write(&path, data).unwrap();
    let req = CloudImageRequest {
        repo: "win".into(),
        tag: "11".into(),
        local_name: "win-bad".into(),
        cocoon_bin: cocoon.bin(),
    };
    let err = pull_cloud_image(&client, &req).expect_err("corrupt part");
    assert!(err.to_string().contains(&d1), "{err}");
    assert!(cocoon.image("win-bad").is_none(), "nothing imported");
}

#[test]
fn manifest_info_absent_tag_and_delete() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    let client = client_for(&reg.host(), AuthSettings::default());
    assert!(manifest_info(&client, "nothing-here", "hibernate")
        .unwrap()
        .is_none());
    cocoon.create_snapshot("vm-d", &small_files());
    let rep = push_snapshot(
        &client,
        &push_req(&cocoon, "vm-d", "hibernate", PushKnobs::default()),
    )
    .unwrap();
    assert!(manifest_info(&client, "vm-d", "hibernate")
        .unwrap()
        .is_some());
    // distribution deletes manifests by digest.
    let by_digest = client.reference("vm-d", &rep.manifest_digest).unwrap();
    client.delete_manifest(&by_digest).expect("delete");
    assert!(manifest_info(&client, "vm-d", "hibernate")
        .unwrap()
        .is_none());
    client
        .delete_manifest(&by_digest)
        .expect("deleting an absent manifest succeeds");
    let err = pull_snapshot(&client, &pull_req(&cocoon, "vm-d", "hibernate", "gone"))
        .expect_err("absent");
    assert!(err.is_not_found(), "{err:?}");
}

// ---------------------------------------------------------------- auth

fn round_trip_small(
    client: &RegistryClient,
    cocoon: &FakeCocoon,
    name: &str,
) -> Result<(), TransferError> {
    if !cocoon.export_path(name).exists() {
        cocoon.create_snapshot(name, &small_files());
    }
    push_snapshot(
        client,
        &push_req(cocoon, name, "latest", PushKnobs::default()),
    )?;
    let local = format!("{name}-imp");
    pull_snapshot(client, &pull_req(cocoon, name, "latest", &local))?;
    assert_same_snapshot(
        &cocoon.export_path(name),
        &cocoon.import_path(&local),
        &local,
    );
    Ok(())
}

fn docker_config(dir: &Path, body: &str) -> PathBuf {
    let p = dir.join("config.json");
    fs::write(&p, body).unwrap();
    p
}

#[test]
fn basic_auth_from_docker_config_and_credential_helper() {
    let Some(reg) = start_registry(Some(("alice", "wonder-land"))) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    let cfgdir = tempfile::tempdir().unwrap();

    // Anonymous is refused.
    let anon = client_for(&reg.host(), AuthSettings::default());
    let err = round_trip_small(&anon, &cocoon, "vm-a").expect_err("anonymous refused");
    assert!(matches!(err, TransferError::Unauthorized(_)), "{err:?}");

    // auths entry with the base64 `auth` field.
    use base64::Engine;
    let auth = base64::engine::general_purpose::STANDARD.encode("alice:wonder-land");
    let p = docker_config(
        cfgdir.path(),
        &format!(
            r#"{{"auths":{{"http://{}":{{"auth":"{auth}"}}}}}}"#,
            reg.host()
        ),
    );
    let c = client_for(
        &reg.host(),
        AuthSettings {
            docker_config: Some(p),
            ..Default::default()
        },
    );
    round_trip_small(&c, &cocoon, "vm-a").expect("basic via auths");

    // Wrong password is a clear auth error.
    let p = docker_config(
        cfgdir.path(),
        &format!(
            r#"{{"auths":{{"{}":{{"username":"alice","password":"nope"}}}}}}"#,
            reg.host()
        ),
    );
    let c = client_for(
        &reg.host(),
        AuthSettings {
            docker_config: Some(p),
            ..Default::default()
        },
    );
    let err = manifest_info(&c, "vm-a", "latest").expect_err("bad password");
    assert!(matches!(err, TransferError::Unauthorized(_)), "{err:?}");

    // credHelpers: docker-credential-test gets the host on stdin.
    let helper = cfgdir.path().join("docker-credential-test");
    let seen = cfgdir.path().join("helper-stdin");
    fs::write(
        &helper,
        format!("#!/bin/sh\n# Test stand-in docker credential helper.\n[ \"$1\" = get ] || exit 1\ncat > {}\necho '{{\"ServerURL\":\"x\",\"Username\":\"alice\",\"Secret\":\"wonder-land\"}}'\n", seen.display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&helper, fs::Permissions::from_mode(0o755)).unwrap();
    let p = docker_config(
        cfgdir.path(),
        &format!(r#"{{"credHelpers":{{"{}":"test"}}}}"#, reg.host()),
    );
    let c = client_for(
        &reg.host(),
        AuthSettings {
            docker_config: Some(p),
            helper_dir: Some(cfgdir.path().to_path_buf()),
            ..Default::default()
        },
    );
    round_trip_small(&c, &cocoon, "vm-h").expect("basic via credential helper");
    assert_eq!(
        fs::read_to_string(&seen).unwrap(),
        reg.host(),
        "helper got the registry host on stdin"
    );
}

// ---- a tiny HTTP toolkit for the token server and the fault-injecting proxy

/// Reads one request head (up to the blank line); returns it as text.
fn read_head(s: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).ok()? == 0 {
            return None;
        }
        if head.is_empty() && b[0] == 0x16 {
            // A TLS ClientHello (the client's HTTPS probe): this is a plain-HTTP server.
            return None;
        }
        head.push(b[0]);
        if head.len() > 64 << 10 {
            return None;
        }
    }
    String::from_utf8(head).ok()
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

fn respond(s: &mut TcpStream, status: &str, extra: &str, body: &str) {
    let _ = write!(s, "HTTP/1.1 {status}\r\nContent-Length: {}\r\nContent-Type: application/json\r\nConnection: close\r\n{extra}\r\n{body}", body.len());
}

fn pipe(mut from: TcpStream, mut to: TcpStream, limit: Option<u64>) {
    let mut buf = vec![0u8; 256 << 10];
    let mut sent = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let n = match limit {
            Some(l) if sent + n as u64 >= l => {
                let _ = to.write_all(&buf[..(l - sent) as usize]);
                let _ = to.shutdown(std::net::Shutdown::Both);
                let _ = from.shutdown(std::net::Shutdown::Both);
                return;
            }
            _ => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
        sent += n as u64;
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// A listener on loopback that runs `handle` on a thread of its own for each connection;
/// returns its port.
fn serve_loopback(handle: impl Fn(TcpStream) + Clone + Send + 'static) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(c) = conn else { continue };
            let handle = handle.clone();
            std::thread::spawn(move || handle(c));
        }
    });
    port
}

/// What the proxy does to requests before forwarding them to the registry.
#[derive(Clone, Default)]
struct ProxyRules {
    /// Drop `Range` headers (a registry that ignores ranges and answers 200).
    strip_range: bool,
    /// Cut this many ranged GET responses after 1 MiB.
    cut_ranges: Arc<AtomicUsize>,
    /// Ranged GETs seen.
    ranges_seen: Arc<AtomicUsize>,
    /// Require `Authorization: Bearer` tokens from this token server (realm URL).
    bearer_realm: Option<String>,
    /// Reject every token (a registry that answers 401 after a token).
    reject_all_tokens: bool,
    /// Cut this many PATCH uploads bigger than 2 MiB after 1 MiB of body.
    cut_patches: Arc<AtomicUsize>,
    patches_seen: Arc<AtomicUsize>,
    /// `GET /v2/` requests seen (pings).
    pings_seen: Arc<AtomicUsize>,
    /// With `bearer_realm`: answer the anonymous ping 200 and ask for tokens only on
    /// repository requests.
    open_ping: bool,
}

/// A loopback proxy in front of the registry: one request per connection (it forces
/// `Connection: close`), optional bearer enforcement and upload interruption.
fn start_proxy(upstream: u16, rules: ProxyRules) -> u16 {
    serve_loopback(move |mut c| {
        let Some(head) = read_head(&mut c) else {
            return;
        };
        let mut lines = head.lines();
        let request_line = lines.next().unwrap_or("").to_string();
        let mut parts = request_line.split(' ');
        let method = parts.next().unwrap_or("").to_string();
        let path = parts.next().unwrap_or("").to_string();
        if method == "GET" && path == "/v2/" {
            rules.pings_seen.fetch_add(1, Ordering::SeqCst);
        }
        let open_ping = rules.open_ping && path == "/v2/";
        if let Some(realm) = rules.bearer_realm.as_ref().filter(|_| !open_ping) {
            if path != "/v2/" || method != "GET" || header(&head, "authorization").is_some() {
                let repo = path
                    .trim_start_matches("/v2/")
                    .split("/blobs/")
                    .next()
                    .unwrap_or("")
                    .split("/manifests/")
                    .next()
                    .unwrap_or("")
                    .to_string();
                let action = match method.as_str() {
                    "GET" | "HEAD" => "pull",
                    "DELETE" => "delete",
                    _ => "push",
                };
                let token = header(&head, "authorization")
                    .and_then(|a| a.strip_prefix("Bearer "))
                    .unwrap_or("");
                let granted = token.strip_prefix("T|").unwrap_or("").split('|').any(|s| {
                    let mut it = s.rsplitn(2, ':');
                    let actions = it.next().unwrap_or("");
                    let scope_repo = it.next().unwrap_or("").trim_start_matches("repository:");
                    (path == "/v2/" || scope_repo == repo)
                        && actions.split(',').any(|a| a == action)
                });
                if !granted || rules.reject_all_tokens {
                    let scope = if path == "/v2/" {
                        String::new()
                    } else {
                        format!(",scope=\"repository:{repo}:{action}\"")
                    };
                    let chall = format!("WWW-Authenticate: Bearer realm=\"{realm}\",service=\"test-registry\"{scope}\r\n");
                    respond(
                        &mut c,
                        "401 Unauthorized",
                        &chall,
                        r#"{"errors":[{"code":"UNAUTHORIZED"}]}"#,
                    );
                    return;
                }
            } else {
                let chall = format!(
                    "WWW-Authenticate: Bearer realm=\"{realm}\",service=\"test-registry\"\r\n"
                );
                respond(&mut c, "401 Unauthorized", &chall, "{}");
                return;
            }
        }
        let Ok(mut up) = TcpStream::connect(("127.0.0.1", upstream)) else {
            return;
        };
        let mut fwd = String::new();
        for (i, line) in head.split("\r\n").enumerate() {
            if line.is_empty() {
                continue;
            }
            if i > 0 && line.to_ascii_lowercase().starts_with("connection:") {
                continue;
            }
            if i > 0 && rules.strip_range && line.to_ascii_lowercase().starts_with("range:") {
                continue;
            }
            fwd.push_str(line);
            fwd.push_str("\r\n");
        }
        fwd.push_str("Connection: close\r\n\r\n");
        if up.write_all(fwd.as_bytes()).is_err() {
            return;
        }
        let mut limit = None;
        if method == "PATCH" {
            rules.patches_seen.fetch_add(1, Ordering::SeqCst);
            let big = header(&head, "content-length")
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|n| n > 2 * MIB);
            if big
                && rules
                    .cut_patches
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
            {
                limit = Some(MIB);
            }
        }
        let mut down_limit = None;
        if header(&head, "range").is_some() {
            rules.ranges_seen.fetch_add(1, Ordering::SeqCst);
            if rules
                .cut_ranges
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                down_limit = Some(MIB);
            }
        }
        let (c2, up2) = (c.try_clone().unwrap(), up.try_clone().unwrap());
        let t = std::thread::spawn(move || pipe(c2, up2, limit));
        pipe(up, c, down_limit);
        let _ = t.join();
    })
}

/// A token endpoint: `GET /token?scope=..&service=..` → `{"token":"T|<scopes>"}`; records
/// the scopes and Authorization headers it saw.
fn start_token_server(seen: Arc<Mutex<Vec<String>>>, require_basic: Option<String>) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            let Some(head) = read_head(&mut c) else {
                continue;
            };
            let target = head.split(' ').nth(1).unwrap_or("").to_string();
            let query = target
                .split_once('?')
                .map(|(_, q)| q.to_string())
                .unwrap_or_default();
            let scopes: Vec<String> = query
                .split('&')
                .filter_map(|kv| kv.strip_prefix("scope="))
                .map(|s| {
                    s.replace("%3A", ":")
                        .replace("%2C", ",")
                        .replace("%2F", "/")
                })
                .collect();
            let authz = header(&head, "authorization").unwrap_or("").to_string();
            seen.lock()
                .unwrap()
                .push(format!("{} auth={authz}", scopes.join(" ")));
            if let Some(want) = &require_basic {
                if &authz != want {
                    respond(&mut c, "401 Unauthorized", "", "{}");
                    continue;
                }
            }
            let body =
                serde_json::json!({"token": format!("T|{}", scopes.join("|")), "expires_in": 300})
                    .to_string();
            respond(&mut c, "200 OK", "", &body);
        }
    });
    port
}

/// A registry behind a proxy that wants bearer tokens from a local token server (`rules`
/// adds the rest). Returns the registry (keep it alive), a client for the proxy, the token
/// requests seen and the pings seen; None when the registry is not installed.
fn bearer_registry(
    rules: ProxyRules,
) -> Option<(Registry, RegistryClient, Tokens, Arc<AtomicUsize>)> {
    let reg = start_registry(None)?;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let tport = start_token_server(seen.clone(), None);
    let rules = ProxyRules {
        bearer_realm: Some(format!("http://127.0.0.1:{tport}/token")),
        ..rules
    };
    let pings = rules.pings_seen.clone();
    let pport = start_proxy(reg.port, rules);
    let client = client_for(&format!("127.0.0.1:{pport}"), AuthSettings::default());
    Some((reg, client, seen, pings))
}

type Tokens = Arc<Mutex<Vec<String>>>;

#[test]
fn bearer_token_flow_with_scopes_per_repository() {
    let Some((_reg, client, seen, pings)) = bearer_registry(ProxyRules::default()) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    round_trip_small(&client, &cocoon, "vm-b").expect("bearer round trip");
    // The host's challenge is remembered: lookups in new repositories (one per VM, as the
    // hibernate evidence does) fetch their own tokens without pinging again.
    let pinged = pings.load(Ordering::SeqCst);
    for vm in ["vm-c", "vm-d", "vm-e"] {
        assert!(manifest_info(&client, vm, "hibernate").unwrap().is_none());
    }
    assert_eq!(
        pings.load(Ordering::SeqCst),
        pinged,
        "no ping per repository"
    );
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|s| s.starts_with("repository:vm-b:push,pull")),
        "push scope requested: {seen:?}"
    );
    assert!(
        seen.iter().any(|s| s.starts_with("repository:vm-b:pull ")),
        "pull scope requested: {seen:?}"
    );
    assert!(
        seen.iter().any(|s| s.starts_with("repository:vm-e:pull ")),
        "a token per new repository: {seen:?}"
    );
    // Tokens are cached per session: a handful of token requests, not one per blob.
    assert!(seen.len() <= 4 + 3, "token requests: {seen:?}");

    // Delete needs its own push,pull,delete session.
    let rep_digest = manifest_info(&client, "vm-b", "latest")
        .unwrap()
        .unwrap()
        .digest;
    client
        .delete_manifest(&client.reference("vm-b", &rep_digest).unwrap())
        .expect("delete with delete scope");
    assert!(manifest_info(&client, "vm-b", "latest").unwrap().is_none());
}

/// A registry whose `/v2/` is open but whose repositories want a token: the 401 on the first
/// request brings the token, as Docker's client does.
#[test]
fn a_bearer_challenge_on_a_request_is_followed_when_the_ping_had_none() {
    let rules = ProxyRules {
        open_ping: true,
        ..Default::default()
    };
    let Some((_reg, client, seen, _)) = bearer_registry(rules) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    round_trip_small(&client, &cocoon, "vm-o").expect("round trip with late challenge");
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter().any(|s| s.contains("repository:vm-o:push,pull")),
        "token asked after the request's 401: {seen:?}"
    );
}

#[test]
fn registry_answering_401_after_a_token_is_a_clear_error() {
    let rules = ProxyRules {
        reject_all_tokens: true,
        ..Default::default()
    };
    let Some((_reg, client, seen, _)) = bearer_registry(rules) else {
        return;
    };
    let err = manifest_info(&client, "vm-x", "latest").expect_err("401 after token");
    assert!(matches!(err, TransferError::Unauthorized(_)), "{err:?}");
    assert!(err.to_string().contains("401 after a fresh token"), "{err}");
    assert!(seen.lock().unwrap().len() <= 3, "bounded token refreshes");
}

// ---- credentials stay with the registry's own origin

/// What a [`start_front`] does with the requests it forwards to the registry.
#[derive(Clone, Default)]
struct FrontRules {
    /// Answer an upload's POST with its Location moved to this `host:port`.
    relocate_uploads_to: Option<String>,
    /// Answer blob GETs with a 307 to this `host:port`.
    redirect_blobs_to: Option<String>,
    /// Authorization to put on every forwarded request (storage that authorises by its own
    /// means, as a presigned URL does), replacing the client's.
    authorize: Option<String>,
    /// `<METHOD> <path> auth=<the client's Authorization header, empty when none>`.
    seen: Arc<Mutex<Vec<String>>>,
}

/// A plain-HTTP front on loopback that forwards one request per connection to the registry,
/// recording the Authorization header each came with.
fn start_front(upstream: u16, rules: FrontRules) -> u16 {
    serve_loopback(move |mut c| {
        let Some(head) = read_head(&mut c) else {
            return;
        };
        let mut words = head.split(' ');
        let method = words.next().unwrap_or("").to_string();
        let path = words.next().unwrap_or("").to_string();
        let authz = header(&head, "authorization").unwrap_or("").to_string();
        rules
            .seen
            .lock()
            .unwrap()
            .push(format!("{method} {path} auth={authz}"));
        if let Some(to) = rules
            .redirect_blobs_to
            .as_ref()
            .filter(|_| method == "GET" && path.contains("/blobs/sha256:"))
        {
            let loc = format!("Location: http://{to}{path}\r\n");
            respond(&mut c, "307 Temporary Redirect", &loc, "");
            return;
        }
        let Ok(mut up) = TcpStream::connect(("127.0.0.1", upstream)) else {
            return;
        };
        let mut fwd = String::new();
        for (i, line) in head.split("\r\n").enumerate() {
            let lower = line.to_ascii_lowercase();
            let auth_line = lower.starts_with("authorization:") && rules.authorize.is_some();
            if line.is_empty() || (i > 0 && (lower.starts_with("connection:") || auth_line)) {
                continue;
            }
            fwd.push_str(line);
            fwd.push_str("\r\n");
        }
        if let Some(a) = &rules.authorize {
            fwd.push_str(&format!("Authorization: {a}\r\n"));
        }
        fwd.push_str("Connection: close\r\n\r\n");
        if up.write_all(fwd.as_bytes()).is_err() {
            return;
        }
        let (c2, up2) = (c.try_clone().unwrap(), up.try_clone().unwrap());
        std::thread::spawn(move || pipe(c2, up2, None));
        let Some(resp) = read_head(&mut up) else {
            return;
        };
        let relocate = rules
            .relocate_uploads_to
            .as_ref()
            .filter(|_| method == "POST" && path.ends_with("/blobs/uploads/"));
        let resp = match relocate {
            None => resp,
            Some(to) => resp
                .split("\r\n")
                .map(|line| match line.split_once(':') {
                    Some((k, v)) if k.eq_ignore_ascii_case("location") => {
                        let v = v.trim();
                        let path = match v.strip_prefix("http://") {
                            Some(rest) => &rest[rest.find('/').unwrap_or(rest.len())..],
                            None => v,
                        };
                        format!("Location: http://{to}{path}")
                    }
                    _ => line.to_string(),
                })
                .collect::<Vec<_>>()
                .join("\r\n"),
        };
        if c.write_all(resp.as_bytes()).is_err() {
            return;
        }
        pipe(up, c, None);
    })
}

/// Basic credentials for `host` in a docker config of its own.
fn basic_config(dir: &Path, host: &str, user: &str, pass: &str) -> AuthSettings {
    let p = docker_config(
        dir,
        &format!(r#"{{"auths":{{"{host}":{{"username":"{user}","password":"{pass}"}}}}}}"#),
    );
    AuthSettings {
        docker_config: Some(p),
        ..Default::default()
    }
}

/// An upload whose POST answers with a Location on another host (`localhost`, not the
/// registry's `127.0.0.1`), and blobs served by a redirect to that host: the transfers work
/// (that host authorises by its own means), and not one request to it carries the registry's
/// credentials, on the spooled upload, the streamed one (a file over the stream threshold)
/// or the pull.
#[test]
fn credentials_never_follow_an_upload_location_or_a_redirect_to_another_host() {
    let Some(reg) = start_registry(Some(("alice", "wonder-land"))) else {
        return;
    };
    use base64::Engine;
    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("alice:wonder-land")
    );
    let other = FrontRules {
        authorize: Some(basic.clone()),
        ..Default::default()
    };
    let other_seen = other.seen.clone();
    let other_port = start_front(reg.port, other);
    let front = FrontRules {
        relocate_uploads_to: Some(format!("localhost:{other_port}")),
        redirect_blobs_to: Some(format!("localhost:{other_port}")),
        ..Default::default()
    };
    let front_seen = front.seen.clone();
    let host = format!("127.0.0.1:{}", start_front(reg.port, front));
    let dir = tempfile::tempdir().unwrap();
    let c = client_for(
        &host,
        basic_config(dir.path(), &host, "alice", "wonder-land"),
    );
    let cocoon = FakeCocoon::new();
    let mut files = small_files();
    files.push(FileSpec {
        name: "overlay.qcow2",
        size: 5 * MIB,
        mode: 0o640,
        sparse: None,
        seed: 21,
    });
    cocoon.create_snapshot("vm-loc", &files);
    round_trip_small(&c, &cocoon, "vm-loc").expect("round trip through the other host");

    let other_seen = other_seen.lock().unwrap().clone();
    for want in ["PATCH", "PUT", "GET"] {
        assert!(
            other_seen.iter().any(|l| l.starts_with(want)),
            "{want} went to the other host: {other_seen:?}"
        );
    }
    let leaked: Vec<&String> = other_seen
        .iter()
        .filter(|l| !l.ends_with("auth="))
        .collect();
    assert!(
        leaked.is_empty(),
        "credentials sent to another host: {leaked:?}"
    );
    let front_seen = front_seen.lock().unwrap().clone();
    assert!(
        front_seen
            .iter()
            .any(|l| l.ends_with(&format!("auth={basic}"))),
        "the registry itself got them: {front_seen:?}"
    );
}

/// A token realm on another host over plain http is refused before any request carries the
/// registry's credentials to it; on the plain-http registry's own host it is used.
#[test]
fn a_plain_http_realm_on_another_host_gets_no_credentials() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let seen = Arc::new(Mutex::new(Vec::new()));
    let tport = start_token_server(seen.clone(), None);
    let dir = tempfile::tempdir().unwrap();
    for (realm_host, allowed) in [("localhost", false), ("127.0.0.1", true)] {
        let rules = ProxyRules {
            bearer_realm: Some(format!("http://{realm_host}:{tport}/token")),
            ..Default::default()
        };
        let host = format!("127.0.0.1:{}", start_proxy(reg.port, rules));
        let c = client_for(&host, basic_config(dir.path(), &host, "alice", "pw"));
        seen.lock().unwrap().clear();
        let r = manifest_info(&c, "vm-r", "latest");
        let asked = seen.lock().unwrap().clone();
        if allowed {
            assert!(r.is_ok(), "{r:?}");
            assert!(!asked.is_empty(), "the token came from the registry's host");
        } else {
            let e = r.expect_err("refused realm");
            assert!(matches!(e, TransferError::Unauthorized(_)), "{e:?}");
            assert!(e.to_string().contains("refused"), "{e}");
            assert!(asked.is_empty(), "the realm was asked: {asked:?}");
        }
    }
}

#[test]
fn interrupted_upload_is_retried_and_completes() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    let rules = ProxyRules {
        bearer_realm: None,
        reject_all_tokens: false,
        cut_patches: Arc::new(AtomicUsize::new(1)),
        patches_seen: Arc::new(AtomicUsize::new(0)),
        ..Default::default()
    };
    let seen = rules.patches_seen.clone();
    let cut = rules.cut_patches.clone();
    let pport = start_proxy(reg.port, rules);
    let client = client_for(&format!("127.0.0.1:{pport}"), AuthSettings::default());
    round_trip_small(&client, &cocoon, "vm-i").expect("push survives one cut upload");
    assert_eq!(cut.load(Ordering::SeqCst), 0, "the cut happened");
    // 4 blobs (3 files + config) plus the one retried PATCH.
    assert_eq!(seen.load(Ordering::SeqCst), 5);
}

#[test]
fn service_account_key_exchanged_at_local_token_endpoint() {
    let Some(reg) = start_registry(Some(("_token", "ya29.local-test-token"))) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let key_pem = dir.path().join("key.pem");
    let gen = Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
        ])
        .arg(&key_pem)
        .output();
    if !gen.map(|o| o.status.success()).unwrap_or(false) {
        eprintln!("SKIP: openssl missing, cannot make a test RSA key");
        return;
    }
    let pub_der = Command::new("openssl")
        .args(["rsa", "-RSAPublicKey_out", "-outform", "DER", "-in"])
        .arg(&key_pem)
        .output()
        .unwrap()
        .stdout;
    // Token endpoint: verifies the RS256 JWT assertion, answers with an access token.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let tport = l.local_addr().unwrap().port();
    let verified = Arc::new(AtomicBool::new(false));
    let v2 = verified.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            let Some(head) = read_head(&mut c) else {
                continue;
            };
            let len: usize = header(&head, "content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let mut body = vec![0u8; len];
            if c.read_exact(&mut body).is_err() {
                continue;
            }
            let form = String::from_utf8_lossy(&body).to_string();
            let assertion = form
                .split('&')
                .find_map(|kv| kv.strip_prefix("assertion="))
                .unwrap_or("")
                .to_string();
            let grant_ok =
                form.contains("grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer");
            let parts: Vec<&str> = assertion.split('.').collect();
            let ok = grant_ok && parts.len() == 3 && {
                use base64::Engine;
                let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
                let sig = b64.decode(parts[2]).unwrap_or_default();
                let key = ring::signature::UnparsedPublicKey::new(
                    &ring::signature::RSA_PKCS1_2048_8192_SHA256,
                    &pub_der,
                );
                let claims: serde_json::Value =
                    serde_json::from_slice(&b64.decode(parts[1]).unwrap_or_default())
                        .unwrap_or_default();
                key.verify(format!("{}.{}", parts[0], parts[1]).as_bytes(), &sig)
                    .is_ok()
                    && claims["iss"] == "sa@test.iam.gserviceaccount.com"
                    && claims["scope"] == "https://www.googleapis.com/auth/cloud-platform"
                    && claims["aud"]
                        .as_str()
                        .is_some_and(|a| a.ends_with("/token"))
            };
            if ok {
                v2.store(true, Ordering::SeqCst);
                respond(
                    &mut c,
                    "200 OK",
                    "",
                    r#"{"access_token":"ya29.local-test-token","expires_in":3599,"token_type":"Bearer"}"#,
                );
            } else {
                respond(
                    &mut c,
                    "400 Bad Request",
                    "",
                    r#"{"error":"invalid_grant"}"#,
                );
            }
        }
    });
    let key = serde_json::json!({
        "type": "service_account", "client_email": "sa@test.iam.gserviceaccount.com",
        "private_key_id": "k1", "private_key": fs::read_to_string(&key_pem).unwrap(),
        "token_uri": format!("http://127.0.0.1:{tport}/token"),
    });
    let key_path = dir.path().join("sa.json");
    fs::write(&key_path, key.to_string()).unwrap();
    let settings = AuthSettings {
        google_credentials: Some(key_path),
        google_all_hosts: true,
        ..Default::default()
    };
    let client = client_for(&reg.host(), settings);
    let cocoon = FakeCocoon::new();
    round_trip_small(&client, &cocoon, "vm-g")
        .expect("push and pull with an ADC token as _token basic credentials");
    assert!(
        verified.load(Ordering::SeqCst),
        "the token endpoint verified an RS256 assertion"
    );
}

#[test]
fn interrupted_streamed_upload_falls_back_to_the_spool_and_completes() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    let files = vec![
        FileSpec {
            name: "config.json",
            size: 4120,
            mode: 0o640,
            sparse: None,
            seed: 21,
        },
        FileSpec {
            name: "overlay.qcow2",
            size: 6 * MIB + 5,
            mode: 0o640,
            sparse: None,
            seed: 22,
        },
    ];
    cocoon.create_snapshot("vm-s", &files);
    let rules = ProxyRules {
        bearer_realm: None,
        reject_all_tokens: false,
        cut_patches: Arc::new(AtomicUsize::new(1)),
        patches_seen: Arc::new(AtomicUsize::new(0)),
        ..Default::default()
    };
    let seen = rules.patches_seen.clone();
    let cut = rules.cut_patches.clone();
    let pport = start_proxy(reg.port, rules);
    let client = client_for(&format!("127.0.0.1:{pport}"), AuthSettings::default());
    push_snapshot(
        &client,
        &push_req(&cocoon, "vm-s", "latest", PushKnobs::default()),
    )
    .expect("push survives a cut stream");
    assert_eq!(cut.load(Ordering::SeqCst), 0, "the streamed PATCH was cut");
    // config.json, the cut stream, its re-send from the spool, the config blob.
    assert_eq!(seen.load(Ordering::SeqCst), 4);
    no_spool_files_left(cocoon.dir.path());
    pull_snapshot(&client, &pull_req(&cocoon, "vm-s", "latest", "s")).expect("pull");
    assert_same_snapshot(&cocoon.export_path("vm-s"), &cocoon.import_path("s"), "s");
}

// ---------------------------------------------------------------- node-wide gates

/// Most `cocoon snapshot <verb>` processes of this fake seen alive at once while `f` runs
/// (polling /proc every few milliseconds).
fn peak_cocoon_processes(cocoon: &FakeCocoon, verb: &str, f: impl FnOnce()) -> usize {
    let bin = cocoon.bin().to_string_lossy().into_owned();
    let stop = AtomicBool::new(false);
    let peak = AtomicUsize::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                let n = fs::read_dir("/proc")
                    .map(|d| {
                        d.flatten()
                            .filter(|e| {
                                let Ok(raw) = fs::read(e.path().join("cmdline")) else {
                                    return false;
                                };
                                let argv: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
                                argv.len() >= 3
                                    && argv[0] == bin.as_bytes()
                                    && argv[1] == b"snapshot"
                                    && argv[2] == verb.as_bytes()
                            })
                            .count()
                    })
                    .unwrap_or(0);
                peak.fetch_max(n, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(3));
            }
        });
        f();
        stop.store(true, Ordering::SeqCst);
    });
    peak.load(Ordering::SeqCst)
}

#[test]
fn node_wide_gates_bound_v2_pulls_to_two_and_pipelined_pushes_to_one() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    cocoon.create_snapshot("g", &small_files());
    let client = client_for(&reg.host(), AuthSettings::default());
    let v2 = PushKnobs {
        zstd_level: 1,
        chunk_size: MIB,
        concurrency: 2,
        memory_budget: 64 * MIB,
    };
    push_snapshot(&client, &push_req(&cocoon, "g", "v2", v2.clone())).expect("push v2");
    push_snapshot(&client, &push_req(&cocoon, "g", "v1", PushKnobs::default())).expect("push v1");
    // Every import and export takes a while, so transfers that may overlap do.
    cocoon.set_faults(
        r#"{"snapshot import": {"slow_ms": 500}, "snapshot export": {"slow_ms": 500}}"#,
    );

    let pulls = |tag: &str, prefix: &str| {
        std::thread::scope(|s| {
            for i in 0..3 {
                let (client, cocoon) = (&client, &cocoon);
                let local = format!("{prefix}{i}");
                s.spawn(move || {
                    pull_snapshot(client, &pull_req(cocoon, "g", tag, &local)).expect("pull")
                });
            }
        })
    };
    let t = Instant::now();
    let peak = peak_cocoon_processes(&cocoon, "import", || pulls("v2", "two-"));
    assert_eq!(peak, 2, "three v2 pulls: two imports at a time");
    assert!(
        t.elapsed() >= Duration::from_millis(1000),
        "the third pull waited for a slot: {:?}",
        t.elapsed()
    );
    assert_eq!(client.v2_pull_gate().peak(), 2);
    assert_eq!(client.v2_pull_gate().in_use(), 0, "permits returned");
    for i in 0..3 {
        assert_same_snapshot(
            &cocoon.export_path("g"),
            &cocoon.import_path(&format!("two-{i}")),
            &format!("two-{i}"),
        );
    }
    // Plain v1 pulls are not gated.
    let peak = peak_cocoon_processes(&cocoon, "import", || pulls("v1", "one-"));
    assert_eq!(peak, 3, "three v1 pulls run side by side");

    let pushes = |knobs: &PushKnobs| {
        std::thread::scope(|s| {
            for i in 0..2 {
                let (client, cocoon) = (&client, &cocoon);
                let req = push_req(cocoon, "g", &format!("p{i}"), knobs.clone());
                s.spawn(move || push_snapshot(client, &req).expect("push"));
            }
        })
    };
    let peak = peak_cocoon_processes(&cocoon, "export", || pushes(&v2));
    assert_eq!(peak, 1, "zstd/chunked pushes one at a time");
    assert_eq!(client.pipelined_push_gate().peak(), 1);
    let peak = peak_cocoon_processes(&cocoon, "export", || pushes(&PushKnobs::default()));
    assert_eq!(peak, 2, "plain v1 pushes are not gated");
}

// ---------------------------------------------------------------- ranged raw blobs

/// A v1 snapshot whose memory file (40 MiB + 5 bytes: five whole 8 MiB pieces and a 5-byte
/// tail) is large enough for the ranged path.
fn ranged_files() -> Vec<FileSpec> {
    vec![
        FileSpec {
            name: "config.json",
            size: 4120,
            mode: 0o640,
            sparse: None,
            seed: 21,
        },
        FileSpec {
            name: "memory-ranges",
            size: 40 * MIB + 5,
            mode: 0o600,
            sparse: None,
            seed: 22,
        },
    ]
}

/// Pushes `ranged_files` as `vm` and returns the memory layer's digest.
fn push_ranged(client: &RegistryClient, cocoon: &FakeCocoon, vm: &str) -> String {
    cocoon.create_snapshot(vm, &ranged_files());
    push_snapshot(
        client,
        &push_req(cocoon, vm, "latest", PushKnobs::default()),
    )
    .expect("push");
    let (body, _) = client
        .get_manifest(&client.reference(vm, "latest").unwrap())
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    v["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["size"].as_u64() == Some(40 * MIB + 5))
        .and_then(|l| l["digest"].as_str())
        .expect("memory layer")
        .to_string()
}

#[test]
fn large_raw_blob_pulls_as_parallel_ranges_byte_identical() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    let client = client_for(&reg.host(), AuthSettings::default());
    push_ranged(&client, &cocoon, "vm-r");
    pull_snapshot(&client, &pull_req(&cocoon, "vm-r", "latest", "r")).expect("pull");
    assert_same_snapshot(&cocoon.export_path("vm-r"), &cocoon.import_path("r"), "r");
    assert_eq!(client.ranged_pieces(), 6, "40 MiB + 5 in 8 MiB pieces");

    // Concurrency 1 keeps the single stream.
    let fresh = client_for(&reg.host(), AuthSettings::default());
    let mut req = pull_req(&cocoon, "vm-r", "latest", "r1");
    req.concurrency = 1;
    pull_snapshot(&fresh, &req).expect("pull");
    assert_same_snapshot(&cocoon.export_path("vm-r"), &cocoon.import_path("r1"), "r1");
    assert_eq!(fresh.ranged_pieces(), 0);
}

#[test]
fn corrupted_large_blob_fails_the_ranged_pull_and_imports_nothing() {
    let Some(reg) = start_registry(None) else {
        return;
    };
    let cocoon = FakeCocoon::new();
    let client = client_for(&reg.host(), AuthSettings::default());
    let digest = push_ranged(&client, &cocoon, "vm-rc");
    // One flipped byte in the middle of the third piece.
    let path = reg.blob_data_path(&digest);
    let mut data = fs::read(&path).expect("blob data in storage");
    data[(20 * MIB) as usize] ^= 0x55;
    fs::write(&path, &data).unwrap();

    let err = pull_snapshot(&client, &pull_req(&cocoon, "vm-rc", "latest", "bad"))
        .expect_err("corruption must fail");
    assert!(matches!(err, TransferError::Integrity(_)), "{err:?}");
    assert!(err.to_string().contains(&digest), "names the digest: {err}");
    assert!(client.ranged_pieces() > 0, "the ranged path ran");
    assert!(!cocoon.import_path("bad").exists(), "nothing imported");
    assert!(!cocoon.snapshot_names().contains(&"bad".to_string()));
    cocoon.assert_no_import_debris();
}

/// Polls until the fake shows an `.import-*` staging directory (bounded wait).
fn wait_for_staging(cocoon: &FakeCocoon) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let found = cocoon.import_staging();
        if !found.is_empty() {
            return found;
        }
        assert!(Instant::now() < deadline, "the import never staged");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Starts `cocoon <args>` on the fake's own state (the directory beside it), every stream
/// piped; `env` is added to its environment.
fn spawn_cocoon(cocoon: &FakeCocoon, args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(cocoon.bin())
        .args(args)
        .envs(env.iter().copied())
        .env_remove("FAKE_COCOON_STATE")
        .env_remove("COCOON_ROOT_DIR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn cocoon")
}

/// Starts `cocoon snapshot import --name NAME` and feeds it the first `bytes` of `archive`,
/// leaving its stdin open.
fn half_import(cocoon: &FakeCocoon, name: &str, archive: &[u8], bytes: usize) -> Child {
    let mut child = spawn_cocoon(cocoon, &["snapshot", "import", "--name", name], &[]);
    child
        .stdin
        .as_mut()
        .expect("stdin")
        .write_all(&archive[..bytes])
        .expect("feed import");
    child
}

#[test]
fn killed_import_leaves_no_staging_but_a_live_import_is_left_alone() {
    let cocoon = FakeCocoon::new();
    let path = cocoon.export_path("k");
    write_export(&path, "SEED", &small_files());
    let archive = fs::read(&path).unwrap();

    // A live import, mid-stream: another command must not sweep its staging directory.
    let mut live = half_import(&cocoon, "live", &archive, (MIB + 512) as usize);
    let staged = wait_for_staging(&cocoon);
    assert_eq!(staged.len(), 1, "{staged:?}");
    assert!(cocoon.cocoon(&["snapshot", "list"]).status.success());
    assert_eq!(
        cocoon.import_staging(),
        staged,
        "a live import keeps its staging"
    );
    let mut stdin = live.stdin.take().unwrap();
    stdin.write_all(&archive[(MIB + 512) as usize..]).unwrap();
    drop(stdin);
    let out = live.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_same_snapshot(&path, &cocoon.import_path("live"), "live");
    assert!(
        cocoon.import_staging().is_empty(),
        "committed import staged nothing"
    );

    // The same import SIGKILLed mid-stream leaves its staging directory behind ...
    let mut killed = half_import(&cocoon, "killed", &archive, (MIB + 512) as usize);
    wait_for_staging(&cocoon);
    killed.kill().unwrap();
    killed.wait().unwrap();
    assert_eq!(
        cocoon.import_staging().len(),
        1,
        "debris of the killed import"
    );
    // ... until the next snapshot command sweeps it, and nothing was registered.
    cocoon.assert_no_import_debris();
    assert!(!cocoon.snapshot_names().contains(&"killed".to_string()));
}

/// Pushes `ranged_files` as `vm`, pulls it through a proxy with `rules` into `local` and
/// checks the import; returns the pulling client and the ranged GETs the proxy saw.
fn ranged_pull_through_proxy(vm: &str, local: &str, rules: ProxyRules) -> Option<(u64, usize)> {
    let reg = start_registry(None)?;
    let cocoon = FakeCocoon::new();
    let direct = client_for(&reg.host(), AuthSettings::default());
    push_ranged(&direct, &cocoon, vm);
    let seen = rules.ranges_seen.clone();
    let pport = start_proxy(reg.port, rules);
    let client = client_for(&format!("127.0.0.1:{pport}"), AuthSettings::default());
    pull_snapshot(&client, &pull_req(&cocoon, vm, "latest", local)).expect("pull");
    assert_same_snapshot(&cocoon.export_path(vm), &cocoon.import_path(local), local);
    Some((client.ranged_pieces(), seen.load(Ordering::SeqCst)))
}

#[test]
fn registry_ignoring_ranges_falls_back_to_one_stream() {
    let rules = ProxyRules {
        strip_range: true,
        ..Default::default()
    };
    let Some((pieces, seen)) = ranged_pull_through_proxy("vm-rf", "f", rules) else {
        return;
    };
    assert!(seen > 0, "ranges were asked for");
    assert_eq!(pieces, 0, "none answered 206");
}

#[test]
fn a_cut_range_response_is_retried_as_one_piece() {
    let rules = ProxyRules {
        cut_ranges: Arc::new(AtomicUsize::new(1)),
        ..Default::default()
    };
    let Some((pieces, seen)) = ranged_pull_through_proxy("vm-rt", "t", rules) else {
        return;
    };
    assert_eq!(pieces, 6);
    assert_eq!(seen, 7, "six pieces, one of them twice");
}

// ---------------------------------------------------------------- discard mode

/// Runs `cocoon <args>` with `FAKE_COCOON_IMPORT_DISCARD=1` and `input` on stdin.
fn discard_import(cocoon: &FakeCocoon, args: &[&str], input: &[u8]) -> std::process::Output {
    let mut child = spawn_cocoon(cocoon, args, &[("FAKE_COCOON_IMPORT_DISCARD", "1")]);
    let mut stdin = child.stdin.take().unwrap();
    // The fake reads to EOF even on a bad stream, so the write never meets a closed pipe.
    stdin.write_all(input).expect("feed import");
    drop(stdin);
    child.wait_with_output().unwrap()
}

/// Bytes of all regular files under `dir`.
fn bytes_under(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => bytes_under(&e.path()),
                    Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
                    _ => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn discard_mode_checks_the_tar_framing_and_stores_nothing() {
    let cocoon = FakeCocoon::new();
    let path = cocoon.export_path("d");
    write_export(&path, "SEED", &small_files());
    let archive = fs::read(&path).unwrap();
    assert!(archive.len() as u64 > 5 * MIB);
    let before = bytes_under(&cocoon.state());

    let ok = discard_import(&cocoon, &["snapshot", "import", "--name", "d"], &archive);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        String::from_utf8_lossy(&ok.stderr).contains("4 members"),
        "snapshot.json and three files (PAX headers belong to their member): {}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(cocoon.snapshot_names().is_empty(), "nothing registered");
    let ok = discard_import(&cocoon, &["image", "import", "img"], &archive);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(cocoon.image("img").is_none(), "no image registered");
    let grew = bytes_under(&cocoon.state()) - before;
    assert!(grew < 64 << 10, "discarding wrote {grew} bytes");

    // Truncated: inside a member body, inside a header, and just the end-of-archive marker cut.
    let header2 = 512 + 512; // snapshot.json's header and (short) body, then the next header
    for cut in [
        archive.len() - 3 * MIB as usize,
        header2 + 100,
        archive.len() - 1024,
    ] {
        for args in [
            &["snapshot", "import", "--name", "d"][..],
            &["image", "import", "img"][..],
        ] {
            let out = discard_import(&cocoon, args, &archive[..cut]);
            assert!(
                !out.status.success(),
                "{args:?} accepted a stream cut at {cut}"
            );
        }
    }
    // A corrupted header checksum fails too.
    let mut bad = archive.clone();
    bad[header2 + 1] ^= 0x20;
    let out = discard_import(&cocoon, &["snapshot", "import", "--name", "d"], &bad);
    assert!(!out.status.success(), "corrupt header accepted");
    assert!(cocoon.snapshot_names().is_empty());
    assert!(cocoon.import_staging().is_empty());
}

// ---------------------------------------------------------------- private CA

/// A test CA and a registry certificate it signed for 127.0.0.1, as PEM files in `dir`:
/// (CA bundle, certificate chain, key).
fn private_ca(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "vk-cocoon test registry CA");
    let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
    let key = KeyPair::generate().expect("registry key");
    let params = CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("registry params");
    let cert = params
        .signed_by(&key, &ca, &ca_key)
        .expect("registry certificate");
    let paths = (
        dir.join("ca.pem"),
        dir.join("registry.crt"),
        dir.join("registry.key"),
    );
    fs::write(&paths.0, ca.pem()).unwrap();
    fs::write(&paths.1, cert.pem() + &ca.pem()).unwrap();
    fs::write(&paths.2, key.serialize_pem()).unwrap();
    (paths.0, paths.1, paths.2)
}

#[test]
fn a_registry_behind_a_private_ca_works_only_with_oci_registry_ca_file() {
    if !Registry::available() {
        eprintln!("SKIP: {REGISTRY_BIN} missing (apt-get install docker-registry)");
        return;
    }
    let pki = tempfile::tempdir().unwrap();
    let (ca, cert, key) = private_ca(pki.path());
    let reg = Registry::start_with(None, None, Some((&cert, &key)));
    let cocoon = FakeCocoon::new();

    // The host's trust store alone: a certificate error that names the fix, and no fall back
    // to plain HTTP (which this loopback host would otherwise be allowed).
    let untrusting = client_for(&reg.host(), AuthSettings::default());
    let err = round_trip_small(&untrusting, &cocoon, "vm-tls").expect_err("untrusted CA");
    let text = format!("{err:?}");
    assert!(matches!(err, TransferError::Transient(_)), "{text}");
    for want in [
        "TLS certificate of https://127.0.0.1:",
        "UnknownIssuer",
        "OCI_REGISTRY_CA_FILE",
    ] {
        assert!(text.contains(want), "{want} missing from {text}");
    }

    // The daemon's construction with OCI_REGISTRY_CA_FILE: push and pull over https.
    let trusting = RegistryClient::from_env(&reg.host(), Some(&ca)).expect("client");
    round_trip_small(&trusting, &cocoon, "vm-tls").expect("push and pull through the CA");
    let info = manifest_info(&trusting, "vm-tls", "latest").expect("manifest over https");
    assert_eq!(info.map(|i| i.kind), Some(ArtifactKind::SnapshotV1));

    // Another CA's bundle is no substitute, even under the same name (its signature fails).
    let other = tempfile::tempdir().unwrap();
    let (other_ca, _, _) = private_ca(other.path());
    let wrong = RegistryClient::from_env(&reg.host(), Some(&other_ca)).expect("client");
    let err = manifest_info(&wrong, "vm-tls", "latest").expect_err("other CA");
    assert!(format!("{err:?}").contains("BadSignature"), "{err:?}");
}
