//! Benchmark of a peer restore of a 1 GiB snapshot against `curl` fetching the same slices
//! from the same listener. Ignored by default; run in release mode:
//!
//!     cargo test --release --test peer_bench -- --ignored --nocapture
//!
//! BENCH_DIR (default the system temp dir) holds the served and staged files; BENCH_MIB the
//! snapshot size (default 1024). Figures are printed, not asserted.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vk_cocoon::peer::client::SLICE_STREAMS;
use vk_cocoon::peer::wire::Plan;
use vk_cocoon::peer::{restore, AllowedPeers, PeerRestore, PeerServer};
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

    let peers = Arc::new(AllowedPeers::default());
    peers.replace(["127.0.0.1".parse().unwrap()]);
    let server = PeerServer::start(
        "127.0.0.1:0".parse().unwrap(),
        served.clone(),
        peers,
        Arc::new(|_: &str| Ok(Some(ID.to_string()))),
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
        staging_root: staging.clone(),
        streams: 1,
    };
    let parallel = PeerRestore {
        streams: SLICE_STREAMS,
        ..req.clone()
    };
    let plan_text = Command::new("curl")
        .args([
            "-sf",
            &format!("http://{addr}/v1/snapshot-plan?name=vk-bench"),
        ])
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
        let mut args = vec!["-sf".to_string()];
        for f in &plan.files {
            for (i, s) in f.slices.iter().enumerate() {
                args.push("-o".into());
                args.push(
                    out.join(format!("{}.{i}", f.name))
                        .to_string_lossy()
                        .into_owned(),
                );
                args.push(format!(
                    "http://{addr}/v1/snapshot-slice?id={ID}&file={}&offset={}&length={}",
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
