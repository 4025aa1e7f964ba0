//! Benchmark (ignored by default): 1 GiB snapshot push / pull through a local docker-registry
//! against curl moving the same bytes, peak RSS of the transfer, and sha256 throughput.
//! Run alone: `cargo test --release --test benches snapshots_bench -- --ignored --nocapture`.
//!
//! `cocoon` is the project's fake (the `vk-cocoon` binary behind a `cocoon` symlink): pushes
//! export a snapshot it holds; pulls import with `FAKE_COCOON_IMPORT_DISCARD=1`, which checks
//! the tar framing and writes nothing, so the pull figure is the transport and not the disk.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::registry_support;

use registry_support::Registry;
use sha2::{Digest, Sha256};
use vk_cocoon::snapshots::auth::AuthSettings;
use vk_cocoon::snapshots::tarstream::TarWriter;
use vk_cocoon::snapshots::{
    pull_snapshot, push_snapshot, PullRequest, PushKnobs, PushRequest, RegistryBase,
    RegistryClient, RetryPolicy,
};

const MIB: u64 = 1 << 20;

fn vm_hwm_kib() -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Resets the peak-RSS counter (Linux: write 5 to clear_refs).
fn reset_hwm() {
    let _ = fs::write("/proc/self/clear_refs", "5");
}

fn write_export(path: &Path, size: u64) {
    let mut w = TarWriter::new(std::io::BufWriter::with_capacity(
        1 << 20,
        fs::File::create(path).unwrap(),
    ));
    let env = b"{\"version\":1,\"config\":{\"id\":\"BENCH\",\"name\":\"bench\",\"hypervisor\":\"cloud-hypervisor\"}}\n";
    w.begin_entry("snapshot.json", env.len() as u64, 0o644, 0, &[])
        .unwrap();
    w.write_body(env).unwrap();
    w.end_entry().unwrap();
    w.begin_entry("memory-ranges", size, 0o600, 0, &[]).unwrap();
    let mut buf = vec![0u8; MIB as usize];
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut off = 0;
    while off < size {
        for c in buf.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes());
        }
        w.write_body(&buf).unwrap();
        off += MIB;
    }
    w.end_entry().unwrap();
    w.finish().unwrap();
}

const FAKE_COCOON: &str = env!("CARGO_BIN_EXE_vk-cocoon-sandbox");

/// The fake cocoon behind `<dir>/bin/cocoon`, its state in `bin/fake-cocoon-state`.
fn fake_cocoon(dir: &Path) -> PathBuf {
    fs::create_dir_all(dir.join("bin/fake-cocoon-state")).unwrap();
    let bin = dir.join("bin/cocoon");
    std::os::unix::fs::symlink(FAKE_COCOON, &bin).unwrap();
    bin
}

/// Stores the archive at `export` in the fake as snapshot `name` (a real, storing import).
fn seed(cocoon: &Path, name: &str, export: &Path) {
    let out = Command::new(cocoon)
        .args(["snapshot", "import", "--name", name])
        .env_remove("FAKE_COCOON_IMPORT_DISCARD")
        .env_remove("FAKE_COCOON_STATE")
        .env_remove("COCOON_ROOT_DIR")
        .stdin(fs::File::open(export).unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "seed {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Names of the fake's snapshots.
fn snapshot_names(cocoon: &Path) -> Vec<String> {
    let out = Command::new(cocoon)
        .args(["snapshot", "list", "-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s["name"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn rate(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / MIB as f64 / d.as_secs_f64()
}

#[test]
#[ignore]
fn bench_1gib_push_pull_vs_curl() {
    if !Registry::available() || Command::new("curl").arg("--version").output().is_err() {
        eprintln!("SKIP: needs docker-registry and curl");
        return;
    }
    let size: u64 = std::env::var("BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024)
        * MIB;
    let work = tempfile::tempdir().unwrap();
    let reg = Registry::start(Some(work.path()), None);
    let host = format!("127.0.0.1:{}", reg.port);
    let cocoon = fake_cocoon(work.path());
    let export = work.path().join("export.tar");
    write_export(&export, size);
    // The pushes export these; v1 and v2 push one repository (= snapshot name) each.
    seed(&cocoon, "bench", &export);
    seed(&cocoon, "bench2", &export);
    // Pull imports (children inherit this) discard after checking the framing. The only test
    // in this binary, so no other thread reads the environment meanwhile.
    std::env::set_var("FAKE_COCOON_IMPORT_DISCARD", "1");

    // sha256 throughput.
    let buf = vec![0xa5u8; 64 << 20];
    let t = Instant::now();
    let mut h = Sha256::new();
    for _ in 0..16 {
        h.update(&buf);
    }
    let _ = h.finalize();
    println!("sha256: {:.0} MiB/s", rate(16 * 64 * MIB, t.elapsed()));
    drop(buf);

    let client = RegistryClient::new(
        RegistryBase::parse(&host).unwrap(),
        AuthSettings::default(),
        RetryPolicy::default(),
    );
    reset_hwm();
    let req = PushRequest {
        name: "bench".into(),
        tag: "latest".into(),
        cocoon_bin: cocoon.clone(),
        base_image: None,
        from_node: None,
        annotations: BTreeMap::new(),
        knobs: PushKnobs::default(),
        temp_dir: Some(work.path().to_path_buf()),
    };
    let t = Instant::now();
    let rep = push_snapshot(&client, &req).expect("push");
    let push_t = t.elapsed();
    let push_rss = vm_hwm_kib();
    println!(
        "push v1: {} MiB in {:.2?} = {:.0} MiB/s, peak RSS {} MiB",
        size / MIB,
        push_t,
        rate(size, push_t),
        push_rss / 1024
    );

    reset_hwm();
    let t = Instant::now();
    let pr = PullRequest {
        repo: "bench".into(),
        tag: "latest".into(),
        local_name: "bench-imp".into(),
        cocoon_bin: cocoon.clone(),
        // BENCH_PULL_CONCURRENCY=1 pulls v1 blobs on one stream instead of parallel ranges.
        concurrency: std::env::var("BENCH_PULL_CONCURRENCY")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(8),
        budget: 2048 * MIB,
    };
    pull_snapshot(&client, &pr).expect("pull");
    let pull_t = t.elapsed();
    let pull_rss = vm_hwm_kib();
    println!(
        "pull v1: {} MiB in {:.2?} = {:.0} MiB/s, peak RSS {} MiB",
        size / MIB,
        pull_t,
        rate(size, pull_t),
        pull_rss / 1024
    );

    // v2 chunked + zstd push for comparison (memory bound by chunk × workers).
    reset_hwm();
    let mut req2 = req.clone();
    req2.name = "bench2".into();
    req2.knobs = PushKnobs {
        zstd_level: 1,
        chunk_size: 4 * MIB,
        concurrency: 4,
        memory_budget: 64 * MIB,
    };
    let t = Instant::now();
    push_snapshot(&client, &req2).expect("push v2");
    let p2 = t.elapsed();
    println!(
        "push v2 (zstd 1, 4 MiB chunks, 4 workers): {:.0} MiB/s, peak RSS {} MiB",
        rate(size, p2),
        vm_hwm_kib() / 1024
    );
    reset_hwm();
    let t = Instant::now();
    let pr2 = PullRequest {
        repo: "bench2".into(),
        ..pr.clone()
    };
    pull_snapshot(&client, &pr2).expect("pull v2");
    println!(
        "pull v2: {:.0} MiB/s, peak RSS {} MiB",
        rate(size, t.elapsed()),
        vm_hwm_kib() / 1024
    );
    // The discarding imports registered nothing.
    let mut names = snapshot_names(&cocoon);
    names.sort();
    assert_eq!(names, ["bench", "bench2"]);

    // curl: the same bytes as one blob upload (POST, PATCH, PUT) and download.
    let body = work.path().join("body.bin");
    {
        let mut f = fs::File::create(&body).unwrap();
        std::io::copy(&mut fs::File::open(&export).unwrap(), &mut f).unwrap();
        f.flush().unwrap();
    }
    let blob_size = fs::metadata(&body).unwrap().len();
    let digest = {
        let mut h = Sha256::new();
        std::io::copy(&mut fs::File::open(&body).unwrap(), &mut h).unwrap();
        format!("sha256:{:x}", h.finalize())
    };
    let t = Instant::now();
    let out = Command::new("curl")
        .args([
            "-s",
            "-i",
            "-X",
            "POST",
            &format!("http://{host}/v2/curl/blobs/uploads/"),
        ])
        .output()
        .unwrap();
    let head = String::from_utf8_lossy(&out.stdout).to_string();
    let loc = head
        .lines()
        .find_map(|l| {
            l.split_once(':')
                .filter(|(k, _)| k.eq_ignore_ascii_case("location"))
                .map(|(_, v)| v)
        })
        .unwrap_or_else(|| panic!("no Location in {head}"))
        .trim()
        .to_string();
    let out = Command::new("curl")
        .args([
            "-s",
            "-i",
            "-X",
            "PATCH",
            "-H",
            "Content-Type: application/octet-stream",
            "-T",
        ])
        .arg(&body)
        .arg(&loc)
        .output()
        .unwrap();
    let head = String::from_utf8_lossy(&out.stdout).to_string();
    let loc = head
        .lines()
        .find_map(|l| {
            l.split_once(':')
                .filter(|(k, _)| k.eq_ignore_ascii_case("location"))
                .map(|(_, v)| v)
        })
        .unwrap_or_else(|| panic!("no Location in {head}"))
        .trim()
        .to_string();
    let sep = if loc.contains('?') { "&" } else { "?" };
    let st = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT"])
        .arg(format!("{loc}{sep}digest={}", digest.replace(':', "%3A")))
        .output()
        .unwrap();
    let curl_up = t.elapsed();
    assert_eq!(String::from_utf8_lossy(&st.stdout), "201");
    println!("curl upload: {:.0} MiB/s", rate(blob_size, curl_up));
    let t = Instant::now();
    let st = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
        .arg(format!("http://{host}/v2/curl/blobs/{digest}"))
        .output()
        .unwrap();
    let curl_down = t.elapsed();
    assert_eq!(String::from_utf8_lossy(&st.stdout), "200");
    println!("curl download: {:.0} MiB/s", rate(blob_size, curl_down));
    // A verifying reference: curl's output hashed by sha256sum (argv only, no shell).
    let t = Instant::now();
    let mut curl = Command::new("curl")
        .arg("-s")
        .arg(format!("http://{host}/v2/curl/blobs/{digest}"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = Command::new("sha256sum")
        .stdin(Stdio::from(curl.stdout.take().unwrap()))
        .output()
        .unwrap();
    curl.wait().unwrap();
    let curl_verified = t.elapsed();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(digest.trim_start_matches("sha256:")));
    println!(
        "curl download | sha256sum: {:.0} MiB/s",
        rate(blob_size, curl_verified)
    );
    println!(
        "push/curl-upload = {:.0}%, pull/curl-download = {:.0}%, pull/(curl | sha256sum) = {:.0}% (manifest {})",
        100.0 * rate(size, push_t) / rate(blob_size, curl_up),
        100.0 * rate(size, pull_t) / rate(blob_size, curl_down),
        100.0 * rate(size, pull_t) / rate(blob_size, curl_verified),
        rep.manifest_digest
    );
}

/// Peak RSS of reading a 30 MB manifest's head (the pull's first parse), beside the JSON tree
/// the pull used to build. Run alone so the process peak is this test's:
/// `cargo test --release --test benches snapshots_bench::manifest_head_memory -- --ignored --nocapture`.
#[test]
#[ignore]
fn manifest_head_memory() {
    use vk_cocoon::snapshots::format::read_head;
    let layer = r#"{"mediaType":"application/vnd.cocoonstack.vm.memory","digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","size":1,"annotations":{"org.opencontainers.image.title":"memory-ranges"}}"#;
    let n = 30_000_000 / (layer.len() + 1);
    let body = format!(
        r#"{{"schemaVersion":2,"artifactType":"application/vnd.cocoonstack.snapshot.v1+json","layers":[{}]}}"#,
        vec![layer; n].join(",")
    );
    let start = vm_hwm_kib();
    let err = read_head(body.as_bytes(), "bench").expect_err("too many layers");
    let head = vm_hwm_kib();
    let tree: serde_json::Value = serde_json::from_slice(body.as_bytes()).unwrap();
    let tree_peak = vm_hwm_kib();
    drop(tree);
    eprintln!(
        "{} MB manifest, {n} layers: peak RSS {} MiB with the body, {} MiB after the head \
         read ({err}), {} MiB after a JSON tree",
        body.len() / 1_000_000,
        start / 1024,
        head / 1024,
        tree_peak / 1024
    );
    assert!(
        head - start < 16 * 1024,
        "the head read grew RSS by {} KiB",
        head - start
    );
}
