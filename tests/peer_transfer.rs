//! The peer snapshot listener and the peer restore client over real loopback TCP: a restore
//! copies every byte and writes the clone envelope; a corrupted transfer, a plan of another
//! snapshot, a peer that is no cluster node, path escapes and the 129th concurrent slice
//! stream are all refused.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vk_cocoon::peer::client::SLICE_STREAMS;
use vk_cocoon::peer::server::MAX_SLICE_STREAMS;
use vk_cocoon::peer::{restore, AllowedPeers, PeerRestore, PeerServer, Resolver};
use vk_cocoon::snapshots::client::sha256_digest;
use vk_cocoon::snapshots::format::{LayerRef, SnapshotConfig, SnapshotFile};

const ID: &str = "01SNAPSHOTID";
const MEM_SIZE: u64 = 64 << 20;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A snapshot directory `<root>/01SNAPSHOTID/` with a sparse memory file (data at both ends),
/// a small config and a disk of pseudo-random bytes; a secret file beside the snapshot dir.
fn snapshot_root() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let snap = root.path().join(ID);
    std::fs::create_dir(&snap).unwrap();
    let mut mem = std::fs::File::create(snap.join("memory-ranges")).unwrap();
    mem.write_all(&[0x5a; 4096]).unwrap();
    mem.seek(SeekFrom::Start(MEM_SIZE - 4096)).unwrap();
    mem.write_all(&[0xa5; 4096]).unwrap();
    std::fs::write(snap.join("config.json"), br#"{"cpus":2}"#).unwrap();
    let mut x = 0x1234_5678u32;
    let disk: Vec<u8> = (0..3 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    std::fs::write(snap.join("cow.raw"), disk).unwrap();
    std::fs::write(root.path().join("secret"), b"TOP-SECRET").unwrap();
    root
}

fn resolver() -> Resolver {
    Arc::new(|name: &str| Ok((name == "vk-demo").then(|| ID.to_string())))
}

fn serve(root: &Path, allowed: &[&str]) -> (PeerServer, Arc<AllowedPeers>) {
    let peers = Arc::new(AllowedPeers::default());
    peers.replace(allowed.iter().map(|s| ip(s)));
    let s = PeerServer::start(
        "127.0.0.1:0".parse().unwrap(),
        root.to_path_buf(),
        peers.clone(),
        resolver(),
    )
    .unwrap();
    (s, peers)
}

fn expected(id: &str) -> SnapshotConfig {
    let mut files = BTreeMap::new();
    for (name, size) in [
        ("memory-ranges", MEM_SIZE as i64),
        ("cow.raw", 3 << 20),
        ("config.json", 10),
    ] {
        files.insert(
            name.to_string(),
            SnapshotFile {
                mode: 0o600,
                size,
                ..Default::default()
            },
        );
    }
    SnapshotConfig {
        schema_version: "v1".into(),
        snapshot_id: id.into(),
        image: "ghcr.io/cocoonstack/cocoon/ubuntu:24.04".into(),
        hypervisor: "cloud-hypervisor".into(),
        cpu: 2,
        memory: 1 << 30,
        files,
        ..Default::default()
    }
}

/// The layers a registry would list for the files of `snap` as they are now: one raw layer
/// per file, its digest the sha256 of the whole file.
fn layers_of(snap: &Path) -> Vec<LayerRef> {
    let mut out: Vec<LayerRef> = entries(snap)
        .into_iter()
        .map(|p| {
            let data = std::fs::read(&p).unwrap();
            LayerRef {
                title: p.file_name().unwrap().to_string_lossy().into_owned(),
                digest: sha256_digest(&data),
                size: data.len() as u64,
                media_type: "application/octet-stream".into(),
            }
        })
        .collect();
    out.sort_by(|a, b| a.title.cmp(&b.title));
    out
}

fn request(root: &Path, peer: SocketAddr, staging: &Path, id: &str) -> PeerRestore {
    PeerRestore {
        peer,
        source: Some(ip("127.0.0.1")),
        snapshot: "vk-demo".into(),
        local_name: "vk-demo-peer".into(),
        expected: expected(id),
        layers: layers_of(&root.join(ID)),
        staging_root: staging.to_path_buf(),
        streams: SLICE_STREAMS,
    }
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// One raw GET from `source`; the whole response as text (lossy).
fn raw_get(addr: SocketAddr, source: &str, target: &str) -> String {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::new(ip(source), 0).into()).unwrap();
    s.connect(&addr.into()).unwrap();
    let mut s: TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {target} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn restore_copies_every_file_and_writes_the_clone_envelope() {
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let (server, _) = serve(root.path(), &["127.0.0.1"]);
    let staged = restore(&request(
        root.path(),
        server.local_addr(),
        staging.path(),
        ID,
    ))
    .unwrap();

    assert_eq!(staged.dir.parent(), Some(staging.path()));
    for name in ["memory-ranges", "cow.raw", "config.json"] {
        let a = std::fs::read(root.path().join(ID).join(name)).unwrap();
        let b = std::fs::read(staged.dir.join(name)).unwrap();
        assert!(a == b, "{name} differs");
    }
    // The 64 MiB memory file's hole is not sent (where the filesystem reports holes).
    assert!(
        staged.bytes < 8 << 20 || staged.bytes == MEM_SIZE + (3 << 20) + 10,
        "{}",
        staged.bytes
    );
    let env: serde_json::Value =
        serde_json::from_slice(&std::fs::read(staged.dir.join("snapshot.json")).unwrap()).unwrap();
    assert_eq!(env["version"], 1);
    assert_eq!(env["config"]["id"], ID);
    assert_eq!(env["config"]["name"], "vk-demo-peer");
    assert_eq!(env["config"]["hypervisor"], "cloud-hypervisor");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(staged.dir.join("cow.raw"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the registry's file mode");
}

/// A proxy that flips the first body byte of every chunked (slice) response.
fn corrupting_proxy(upstream: SocketAddr) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut up = TcpStream::connect(upstream).unwrap();
                let mut down = c;
                let mut req = [0u8; 4096];
                let n = down.read(&mut req).unwrap_or(0);
                up.write_all(&req[..n]).unwrap();
                let mut buf = Vec::new();
                let mut tmp = [0u8; 65536];
                let mut flipped = false;
                loop {
                    let n = up.read(&mut tmp).unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&tmp[..n]);
                    if !flipped {
                        let text = String::from_utf8_lossy(&buf).into_owned();
                        let Some(head_end) = text.find("\r\n\r\n") else {
                            continue;
                        };
                        if !text[..head_end].contains("chunked") {
                            flipped = true;
                        } else {
                            let Some(line) = text[head_end + 4..].find("\r\n") else {
                                continue;
                            };
                            let at = head_end + 4 + line + 2;
                            if buf.len() <= at {
                                continue;
                            }
                            buf[at] ^= 0xff;
                            flipped = true;
                        }
                    }
                    if down.write_all(&buf).is_err() {
                        break;
                    }
                    buf.clear();
                }
            });
        }
    });
    addr
}

#[test]
fn a_corrupted_transfer_stages_nothing() {
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let (server, _) = serve(root.path(), &["127.0.0.1"]);
    let proxy = corrupting_proxy(server.local_addr());
    let err = restore(&request(root.path(), proxy, staging.path(), ID)).unwrap_err();
    assert!(err.contains("CRC-32C"), "{err}");
    assert!(
        entries(staging.path()).is_empty(),
        "{:?}",
        entries(staging.path())
    );
}

/// A peer that lies: its file differs from what the registry tag holds, and it sends the
/// CRC-32C of the bytes it sends, so every slice checks out. The layer digests do not.
#[test]
fn a_peer_serving_other_bytes_with_matching_crcs_stages_nothing() {
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let (server, _) = serve(root.path(), &["127.0.0.1"]);
    let req = request(root.path(), server.local_addr(), staging.path(), ID);
    // Same length, one byte changed after the registry's digests were taken.
    let disk = root.path().join(ID).join("cow.raw");
    let mut f = std::fs::OpenOptions::new().write(true).open(&disk).unwrap();
    f.seek(SeekFrom::Start(1 << 20)).unwrap();
    f.write_all(b"\0evil").unwrap();
    drop(f);
    let err = restore(&req).unwrap_err();
    assert!(err.contains("sha256") && err.contains("cow.raw"), "{err}");
    assert!(
        entries(staging.path()).is_empty(),
        "{:?}",
        entries(staging.path())
    );
    // A byte planted in the memory file's hole is caught as well.
    let req = request(root.path(), server.local_addr(), staging.path(), ID);
    let mem = root.path().join(ID).join("memory-ranges");
    let mut f = std::fs::OpenOptions::new().write(true).open(&mem).unwrap();
    f.seek(SeekFrom::Start(MEM_SIZE / 2)).unwrap();
    f.write_all(b"x").unwrap();
    drop(f);
    let err = restore(&req).unwrap_err();
    assert!(err.contains("memory-ranges"), "{err}");
    assert!(entries(staging.path()).is_empty());
}

/// A manifest whose layers a raw copy cannot reproduce (zstd) is never fetched from a peer.
#[test]
fn a_snapshot_with_zstd_layers_is_not_fetched_from_a_peer() {
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let (server, _) = serve(root.path(), &["127.0.0.1"]);
    let mut req = request(root.path(), server.local_addr(), staging.path(), ID);
    req.layers[0].media_type = "application/vnd.cocoonstack.vm.memory+zstd".into();
    let err = restore(&req).unwrap_err();
    assert!(err.contains("zstd"), "{err}");
    assert!(entries(staging.path()).is_empty());
}

#[test]
fn a_peer_holding_another_snapshot_is_not_used() {
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let (server, _) = serve(root.path(), &["127.0.0.1"]);
    let err = restore(&request(
        root.path(),
        server.local_addr(),
        staging.path(),
        "01NEWERPUSH",
    ))
    .unwrap_err();
    assert!(err.contains("01NEWERPUSH"), "{err}");
    assert!(entries(staging.path()).is_empty());
    // A file the registry lists but the peer lacks is refused too.
    let mut req = request(root.path(), server.local_addr(), staging.path(), ID);
    req.expected
        .files
        .insert("state.json".into(), SnapshotFile::default());
    let err = restore(&req).unwrap_err();
    assert!(err.contains("state.json"), "{err}");
    assert!(entries(staging.path()).is_empty());
}

#[test]
fn only_cluster_node_addresses_are_answered() {
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let (server, peers) = serve(root.path(), &["127.0.0.2"]);
    let addr = server.local_addr();
    let plan = "/v1/snapshot-plan?name=vk-demo";
    assert!(raw_get(addr, "127.0.0.3", plan).starts_with("HTTP/1.1 403"));
    assert!(raw_get(addr, "127.0.0.1", plan).starts_with("HTTP/1.1 403"));
    let ok = raw_get(addr, "127.0.0.2", plan);
    assert!(ok.starts_with("HTTP/1.1 200") && ok.contains(ID), "{ok}");
    let err = restore(&request(root.path(), addr, staging.path(), ID)).unwrap_err();
    assert!(err.contains("403"), "{err}");
    assert!(entries(staging.path()).is_empty());
    // The allowlist follows the Node list.
    peers.replace([ip("127.0.0.1")]);
    assert!(raw_get(addr, "127.0.0.2", plan).starts_with("HTTP/1.1 403"));
    assert!(restore(&request(root.path(), addr, staging.path(), ID)).is_ok());
}

#[test]
fn nothing_outside_the_snapshot_directory_is_served() {
    let root = snapshot_root();
    let (server, _) = serve(root.path(), &["127.0.0.1"]);
    let addr = server.local_addr();
    let snap = root.path().join(ID);
    std::os::unix::fs::symlink(root.path().join("secret"), snap.join("link")).unwrap();
    std::os::unix::fs::symlink(root.path(), root.path().join("up")).unwrap();
    std::fs::create_dir(root.path().join("plain")).unwrap();
    std::fs::write(root.path().join("plain/ok"), b"TOP-SECRET in a snapshot").unwrap();
    for target in [
        "/v1/snapshot-slice?id=..&file=secret&offset=0&length=10",
        "/v1/snapshot-slice?id=%2E%2E&file=secret&offset=0&length=10",
        "/v1/snapshot-slice?id=01SNAPSHOTID&file=..%2Fsecret&offset=0&length=10",
        "/v1/snapshot-slice?id=01SNAPSHOTID&file=link&offset=0&length=10",
        "/v1/snapshot-slice?id=up&file=secret&offset=0&length=10",
        "/v1/snapshot-slice?id=01SNAPSHOTID%2F..&file=secret&offset=0&length=10",
        "/v1/snapshot-slice?id=/&file=etc%2Fpasswd&offset=0&length=10",
        "/v1/snapshot-plan?name=..%2F..",
        "/v1/snapshot-plan?name=-rf",
        "/../secret",
    ] {
        let r = raw_get(addr, "127.0.0.1", target);
        assert!(!r.contains("TOP-SECRET"), "{target}: {r}");
        assert!(r.starts_with("HTTP/1.1 4"), "{target}: {r}");
    }
    // The plan lists neither the symlink nor anything outside.
    let plan = raw_get(addr, "127.0.0.1", "/v1/snapshot-plan?name=vk-demo");
    assert!(plan.contains("cow.raw") && !plan.contains("link"), "{plan}");
    // A regular file in another snapshot dir is served: the check is by path, not content.
    let ok = raw_get(
        addr,
        "127.0.0.1",
        "/v1/snapshot-slice?id=plain&file=ok&offset=0&length=10",
    );
    assert!(
        ok.contains("TOP-SECRET") && ok.to_ascii_lowercase().contains("x-slice-crc32c"),
        "{ok}"
    );
    // Beyond the end of the file.
    let r = raw_get(
        addr,
        "127.0.0.1",
        "/v1/snapshot-slice?id=plain&file=ok&offset=20&length=10",
    );
    assert!(r.starts_with("HTTP/1.1 416"), "{r}");
}

#[test]
fn the_stream_past_the_slice_stream_cap_gets_503() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join(ID)).unwrap();
    let big = std::fs::File::create(root.path().join(ID).join("mem")).unwrap();
    big.set_len(256 << 20).unwrap();
    let (server, _) = serve(root.path(), &["127.0.0.1"]);
    let addr = server.local_addr();
    let target = format!(
        "/v1/snapshot-slice?id={ID}&file=mem&offset=0&length={}",
        256 << 20
    );
    // Streams whose readers do not read: each holds its slot while the server is blocked.
    let mut held = Vec::new();
    for _ in 0..MAX_SLICE_STREAMS {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.set_recv_buffer_size(4096).unwrap();
        s.connect(&addr.into()).unwrap();
        let mut s: TcpStream = s.into();
        write!(s, "GET {target} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        held.push(s);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.slice_streams() < MAX_SLICE_STREAMS {
        assert!(
            Instant::now() < deadline,
            "only {} streams",
            server.slice_streams()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = raw_get(addr, "127.0.0.1", &target);
    assert!(r.starts_with("HTTP/1.1 503"), "{}", &r[..r.len().min(200)]);
    assert!(r.contains("Retry-After"));
    // A plan is still answered while the slice streams are busy.
    let plan = raw_get(addr, "127.0.0.1", "/v1/snapshot-plan?name=vk-demo");
    assert!(plan.starts_with("HTTP/1.1 200"), "{plan}");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.slice_streams() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} streams left",
            server.slice_streams()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let ok = raw_get(
        addr,
        "127.0.0.1",
        &format!("/v1/snapshot-slice?id={ID}&file=mem&offset=0&length=16"),
    );
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
}
