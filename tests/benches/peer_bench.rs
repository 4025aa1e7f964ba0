//! Benchmark of a peer restore of a 1 GiB snapshot over TLS (a node client certificate, the
//! tag's manifest digest) against `curl` fetching the same slices from the same listener with
//! the same certificate. Ignored by default; run in release mode:
//!
//!     cargo test --release --test benches peer_bench -- --ignored --nocapture
//!
//! BENCH_DIR (default the system temp dir) holds the served and staged files; BENCH_MIB the
//! snapshot size (default 1024). Figures are printed, not asserted.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vk_cocoon::kubelet::tls::{TlsSettings, TlsState};
use vk_cocoon::peer::client::{client_tls, SLICE_STREAMS};
use vk_cocoon::peer::wire::Plan;
use vk_cocoon::peer::{restore, ClusterNodes, PeerRestore, PeerServer, PushedSnapshots, Serving};
use vk_cocoon::sandbox::apiserver::{ApiServer, ApiServerOptions};
use vk_cocoon::snapshots::client::sha256_digest;
use vk_cocoon::snapshots::format::{LayerRef, SnapshotConfig};

const ID: &str = "01BENCHSNAPSHOT";

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn rate(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / (1 << 20) as f64
}

fn write_dense(path: &Path, mib: u64) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut block = vec![0u8; 1 << 20];
    for _ in 0..mib {
        for w in block.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        f.write_all(&block).unwrap();
    }
    f.flush().unwrap();
}

#[test]
#[ignore]
fn peer_restore_vs_curl() {
    let mib: u64 = std::env::var("BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let base = std::env::var("BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir());
    let dir = tempfile::tempdir_in(base).unwrap();
    let served = dir.path().join("served");
    std::fs::create_dir_all(served.join(ID)).unwrap();
    write_dense(&served.join(ID).join("memory-ranges"), mib);
    std::fs::write(served.join(ID).join("config.json"), b"{}").unwrap();

    // The cluster CA (the fake API server's) and node-b's client certificate, also as files
    // for curl.
    let api = ApiServer::start(ApiServerOptions::default()).unwrap();
    let (cert, key) = api
        .issue_client_cert_with_groups("system:node:node-b", &["vk-cocoon:nodes"])
        .unwrap();
    let (cert_file, key_file) = (dir.path().join("node-b.crt"), dir.path().join("node-b.key"));
    std::fs::write(&cert_file, &cert).unwrap();
    std::fs::write(&key_file, &key).unwrap();
    let nodes = Arc::new(ClusterNodes::new(Arc::new(|name: &str| {
        Ok((name == "node-b").then(|| "127.0.0.1".parse().unwrap()))
    })));
    let digest = sha256_digest(b"the manifest of vk-bench:hibernate");
    let pushed = Arc::new(PushedSnapshots::in_memory());
    pushed.record("vk-bench", "hibernate", &digest, ID).unwrap();
    let tls = TlsState::requiring_client_certs(TlsSettings {
        cert_path: Default::default(),
        key_path: Default::default(),
        node_name: "node-a".into(),
        node_ip: None,
        client_ca_pem: Some(api.ca_pem().into_bytes()),
    })
    .unwrap();
    let server = PeerServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Serving {
            root: served.clone(),
            resolve: Arc::new(|_: &str| Ok(Some(ID.to_string()))),
            pushed,
            nodes,
            tls,
        },
    )
    .unwrap();
    let addr: SocketAddr = server.local_addr();
    let staging = dir.path().join("staging");
    let req = PeerRestore {
        peer: addr,
        source: None,
        snapshot: "vk-bench".into(),
        local_name: "vk-bench".into(),
        expected: SnapshotConfig {
            snapshot_id: ID.into(),
            ..Default::default()
        },
        // The registry's layers: the restore checks every byte against them.
        layers: ["config.json", "memory-ranges"]
            .iter()
            .map(|name| {
                let data = std::fs::read(served.join(ID).join(name)).unwrap();
                LayerRef {
                    title: name.to_string(),
                    digest: sha256_digest(&data),
                    size: data.len() as u64,
                    media_type: "application/octet-stream".into(),
                }
            })
            .collect(),
        manifest_digest: digest.clone(),
        tls: client_tls(cert.as_bytes(), key.as_bytes()).unwrap(),
        staging_root: staging.clone(),
        streams: 1,
    };
    let parallel = PeerRestore {
        streams: SLICE_STREAMS,
        ..req.clone()
    };
    let curl_tls = [
        "-skf".to_string(),
        "--cert".to_string(),
        cert_file.to_string_lossy().into_owned(),
        "--key".to_string(),
        key_file.to_string_lossy().into_owned(),
    ];
    let plan_text = Command::new("curl")
        .args(&curl_tls)
        .arg(format!(
            "https://{addr}/v1/snapshot-plan?name=vk-bench&digest={digest}"
        ))
        .output()
        .unwrap();
    let plan: Plan = serde_json::from_slice(&plan_text.stdout).unwrap();
    let bytes: u64 = plan
        .files
        .iter()
        .flat_map(|f| &f.slices)
        .map(|s| s.length)
        .sum();

    let mut ours = Vec::new();
    let mut ours_parallel = Vec::new();
    let mut theirs = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let staged = restore(&req).unwrap();
        ours.push(t.elapsed());
        std::fs::remove_dir_all(&staged.dir).unwrap();

        let t = Instant::now();
        let staged = restore(&parallel).unwrap();
        ours_parallel.push(t.elapsed());
        std::fs::remove_dir_all(&staged.dir).unwrap();

        let out = dir.path().join("curl");
        std::fs::create_dir_all(&out).unwrap();
        let mut args = curl_tls.to_vec();
        for f in &plan.files {
            for (i, s) in f.slices.iter().enumerate() {
                args.push("-o".into());
                args.push(
                    out.join(format!("{}.{i}", f.name))
                        .to_string_lossy()
                        .into_owned(),
                );
                args.push(format!(
                    "https://{addr}/v1/snapshot-slice?id={ID}&file={}&offset={}&length={}&digest={digest}",
                    f.name, s.offset, s.length
                ));
            }
        }
        let t = Instant::now();
        let st = Command::new("curl").args(&args).status().unwrap();
        theirs.push(t.elapsed());
        assert!(st.success());
        std::fs::remove_dir_all(&out).unwrap();
    }
    let (o, p, c) = (
        median(ours.clone()),
        median(ours_parallel.clone()),
        median(theirs.clone()),
    );
    println!(
        "peer restore of {mib} MiB ({} slices), 1 stream, sha256 checked: median {:.3} s = {:.0} MiB/s (runs {:?})",
        plan.files.iter().map(|f| f.slices.len()).sum::<usize>(),
        o.as_secs_f64(),
        rate(bytes, o),
        ours
    );
    println!(
        "peer restore, {SLICE_STREAMS} streams, sha256 checked:          median {:.3} s = {:.0} MiB/s (runs {:?})",
        p.as_secs_f64(),
        rate(bytes, p),
        ours_parallel
    );
    println!(
        "curl of the same slices:          median {:.3} s = {:.0} MiB/s (runs {:?})",
        c.as_secs_f64(),
        rate(bytes, c),
        theirs
    );
}
