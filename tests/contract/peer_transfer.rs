//! The peer snapshot listener and the peer restore client over real loopback TLS: a restore
//! copies every byte and writes the clone envelope, and nothing of the snapshot crosses in
//! clear text; a caller without a node's client certificate, with another node's, from an
//! address that is not its Node's, in plain HTTP, or naming the wrong manifest digest gets
//! nothing; Nodes are looked up one GET per TTL, unknown names one per negative TTL;
//! a tampered stream, a lying peer, a plan of another snapshot, path escapes and the 129th
//! concurrent slice stream are all refused.

use crate::peer_support;

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use peer_support::{
    connect_with, ip, plain_get, tls_get, tls_request_over, with_certificate, without_certificate,
};
use vk_cocoon::kube::{Client, KubeOptions};
use vk_cocoon::kubelet::tls::{TlsSettings, TlsState};
use vk_cocoon::peer::client::SLICE_STREAMS;
use vk_cocoon::peer::nodes::{api_lookup, NODE_TTL, UNKNOWN_TTL};
use vk_cocoon::peer::server::MAX_SLICE_STREAMS;
use vk_cocoon::peer::{
    restore, ClusterNodes, PeerRestore, PeerServer, PushedSnapshots, Resolver, Serving,
};
use vk_cocoon::sandbox::apiserver::{ApiServer, ApiServerHandle, ApiServerOptions, KubeconfigAuth};
use vk_cocoon::snapshots::client::sha256_digest;
use vk_cocoon::snapshots::format::{LayerRef, SnapshotConfig, SnapshotFile};

const ID: &str = "01SNAPSHOTID";
const MEM_SIZE: u64 = 64 << 20;
/// Bytes of the snapshot's config file: they must never be seen on the wire.
const MARKER: &[u8] = b"SNAPSHOT-MARKER-7d1f0c";

/// The manifest digest the server recorded when it pushed `vk-demo`.
fn digest() -> String {
    sha256_digest(b"the manifest of vk-demo:hibernate")
}

/// A snapshot directory `<root>/01SNAPSHOTID/` with a sparse memory file (data at both ends),
/// a small config holding `MARKER` and a disk of pseudo-random bytes; a secret file beside
/// the snapshot dir.
fn snapshot_root() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let snap = root.path().join(ID);
    std::fs::create_dir(&snap).unwrap();
    let mut mem = std::fs::File::create(snap.join("memory-ranges")).unwrap();
    mem.write_all(&[0x5a; 4096]).unwrap();
    mem.seek(SeekFrom::Start(MEM_SIZE - 4096)).unwrap();
    mem.write_all(&[0xa5; 4096]).unwrap();
    std::fs::write(snap.join("config.json"), MARKER).unwrap();
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

/// The cluster: its CA (the fake API server's) signs the nodes' client certificates.
struct Cluster {
    api: ApiServerHandle,
}

impl Cluster {
    fn new() -> Cluster {
        Cluster {
            api: ApiServer::start(ApiServerOptions::default()).unwrap(),
        }
    }

    /// A client certificate of `cn` in `groups`.
    fn cert(&self, cn: &str, groups: &[&str]) -> (String, String) {
        self.api.issue_client_cert_with_groups(cn, groups).unwrap()
    }

    /// The certificate node-b's kubeconfig holds.
    fn node_b(&self) -> (String, String) {
        self.cert("system:node:node-b", &["vk-cocoon:nodes"])
    }

    /// Creates Node `name` with InternalIP `address`, or moves it there.
    fn put_node(&self, name: &str, address: &str) {
        let _ = self.api.delete_node(name);
        let node: Node = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name},
            "status": {"addresses": [{"type": "InternalIP", "address": address}]},
        }))
        .unwrap();
        self.api.create_node(&node).unwrap();
    }

    /// The `get nodes` requests node-a has made so far.
    fn node_gets(&self) -> u64 {
        self.api
            .request_counts()
            .iter()
            .filter(|c| c.user == NODE_A && c.verb == "get" && c.resource == "nodes")
            .map(|c| c.count)
            .sum()
    }
}

/// The serving node's identity at the API server.
const NODE_A: &str = "system:node:node-a";

/// A listener serving `root` as node-a, whose records say it pushed `vk-demo` (id `ID`) with
/// manifest `digest()`; `nodes` are the cluster's Nodes (name, InternalIP), created in the
/// fake API server, which node-a looks up one at a time as `system:node:node-a`. The resolver
/// counts its calls: a refused request must not reach it.
struct Served {
    server: PeerServer,
    resolved: Arc<AtomicUsize>,
    _kubeconfig: tempfile::TempDir,
}

fn serve(cluster: &Cluster, root: &Path, nodes: &[(&str, &str)]) -> Served {
    serve_with_ttls(cluster, root, nodes, NODE_TTL, UNKNOWN_TTL)
}

fn serve_with_ttls(
    cluster: &Cluster,
    root: &Path,
    nodes: &[(&str, &str)],
    ttl: Duration,
    unknown_ttl: Duration,
) -> Served {
    for (name, address) in nodes {
        cluster.put_node(name, address);
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    cluster
        .api
        .write_kubeconfig(
            &kubeconfig,
            &KubeconfigAuth::ClientCert {
                user: NODE_A.into(),
                groups: vec!["vk-cocoon:nodes".into()],
            },
        )
        .unwrap();
    let kube = Client::from_env(&KubeOptions {
        kubeconfig: Some(kubeconfig.to_string_lossy().into_owned()),
        timeout: Duration::from_secs(5),
        ..KubeOptions::default()
    })
    .unwrap();
    let table = Arc::new(ClusterNodes::with_ttls(
        api_lookup(Arc::new(kube)),
        ttl,
        unknown_ttl,
    ));
    let pushed = Arc::new(PushedSnapshots::in_memory());
    pushed
        .record("vk-demo", "hibernate", &digest(), ID)
        .unwrap();
    let resolved = Arc::new(AtomicUsize::new(0));
    let count = resolved.clone();
    let resolve: Resolver = Arc::new(move |name: &str| {
        count.fetch_add(1, Ordering::SeqCst);
        Ok((name == "vk-demo").then(|| ID.to_string()))
    });
    let tls = TlsState::requiring_client_certs(TlsSettings {
        cert_path: PathBuf::new(),
        key_path: PathBuf::new(),
        node_name: "node-a".into(),
        node_ip: None,
        client_ca_pem: Some(cluster.api.ca_pem().into_bytes()),
    })
    .unwrap();
    let server = PeerServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Serving {
            root: root.to_path_buf(),
            resolve,
            pushed,
            nodes: table,
            tls,
        },
    )
    .unwrap();
    Served {
        server,
        resolved,
        _kubeconfig: dir,
    }
}

fn expected(id: &str) -> SnapshotConfig {
    let mut files = BTreeMap::new();
    for (name, size) in [
        ("memory-ranges", MEM_SIZE as i64),
        ("cow.raw", 3 << 20),
        ("config.json", MARKER.len() as i64),
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

fn request(
    cluster: &Cluster,
    root: &Path,
    peer: SocketAddr,
    staging: &Path,
    id: &str,
) -> PeerRestore {
    PeerRestore {
        peer,
        source: Some(ip("127.0.0.1")),
        snapshot: "vk-demo".into(),
        local_name: "vk-demo-peer".into(),
        expected: expected(id),
        layers: layers_of(&root.join(ID)),
        manifest_digest: digest(),
        tls: with_certificate(&cluster.node_b()),
        staging_root: staging.to_path_buf(),
        streams: SLICE_STREAMS,
    }
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// The plan request of `vk-demo` naming `digest`.
fn plan_target(digest: &str) -> String {
    format!("/v1/snapshot-plan?name=vk-demo&digest={digest}")
}

/// A slice request of `ID` naming `digest`.
fn slice_target(file: &str, offset: u64, length: u64, digest: &str) -> String {
    format!(
        "/v1/snapshot-slice?id={ID}&file={file}&offset={offset}&length={length}&digest={digest}"
    )
}

#[test]
fn restore_copies_every_file_and_writes_the_clone_envelope() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let served = serve(&cluster, root.path(), &[("node-b", "127.0.0.1")]);
    let staged = restore(&request(
        &cluster,
        root.path(),
        served.server.local_addr(),
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
        staged.bytes < 8 << 20 || staged.bytes == MEM_SIZE + (3 << 20) + MARKER.len() as u64,
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

/// A TCP relay to `upstream` that records both directions; `flip_at` flips the byte at that
/// offset of the stream from upstream.
struct Relay {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<u8>>>,
}

fn relay(upstream: SocketAddr, flip_at: Option<usize>) -> Relay {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for down in l.incoming().flatten() {
            let Ok(up) = TcpStream::connect(upstream) else {
                continue;
            };
            let pipe = |mut from: TcpStream, mut to: TcpStream, flip: Option<usize>| {
                let record = record.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 65536];
                    let mut at = 0usize;
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if let Some(f) = flip.filter(|f| (at..at + n).contains(f)) {
                            buf[f - at] ^= 0xff;
                        }
                        at += n;
                        record.lock().unwrap().extend_from_slice(&buf[..n]);
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            };
            pipe(down.try_clone().unwrap(), up.try_clone().unwrap(), None);
            pipe(up, down, flip_at);
        }
    });
    Relay { addr, seen }
}

/// A byte changed on the wire breaks the TLS record it is in: the restore fails, stages
/// nothing, and no tampered byte reaches a file.
#[test]
fn a_tampered_stream_stages_nothing() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let served = serve(&cluster, root.path(), &[("node-b", "127.0.0.1")]);
    // Past the handshake, inside the slices.
    let proxy = relay(served.server.local_addr(), Some(256 << 10));
    let req = request(&cluster, root.path(), proxy.addr, staging.path(), ID);
    let err = restore(&req).unwrap_err().to_string();
    assert!(!err.is_empty());
    assert!(
        entries(staging.path()).is_empty(),
        "{:?}",
        entries(staging.path())
    );
}

/// Everything between the nodes is TLS: a capture of the loopback stream of a whole restore
/// holds neither the snapshot's bytes nor the manifest digest the client named.
#[test]
fn nothing_of_the_snapshot_crosses_in_clear_text() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let served = serve(&cluster, root.path(), &[("node-b", "127.0.0.1")]);
    let proxy = relay(served.server.local_addr(), None);
    let staged = restore(&request(
        &cluster,
        root.path(),
        proxy.addr,
        staging.path(),
        ID,
    ))
    .unwrap();
    assert_eq!(
        std::fs::read(staged.dir.join("config.json")).unwrap(),
        MARKER
    );
    let seen = proxy.seen.lock().unwrap().clone();
    assert!(
        seen.len() > 3 << 20,
        "the whole restore went through: {}",
        seen.len()
    );
    let disk = std::fs::read(root.path().join(ID).join("cow.raw")).unwrap();
    let find = |needle: &[u8]| seen.windows(needle.len()).any(|w| w == needle);
    assert!(
        !find(MARKER),
        "the config file's bytes crossed in clear text"
    );
    assert!(
        !find(&disk[1 << 20..(1 << 20) + 64]),
        "disk bytes crossed in clear text"
    );
    assert!(
        !find(digest().as_bytes()),
        "the manifest digest crossed in clear text"
    );
    assert!(!find(b"snapshot-plan"), "the request crossed in clear text");
}

/// A peer that lies: its file differs from what the registry tag holds, and it sends the
/// CRC-32C of the bytes it sends, so every slice checks out. The layer digests do not.
#[test]
fn a_peer_serving_other_bytes_with_matching_crcs_stages_nothing() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let served = serve(&cluster, root.path(), &[("node-b", "127.0.0.1")]);
    let addr = served.server.local_addr();
    let req = request(&cluster, root.path(), addr, staging.path(), ID);
    // Same length, one byte changed after the registry's digests were taken.
    let disk = root.path().join(ID).join("cow.raw");
    let mut f = std::fs::OpenOptions::new().write(true).open(&disk).unwrap();
    f.seek(SeekFrom::Start(1 << 20)).unwrap();
    f.write_all(b"\0evil").unwrap();
    drop(f);
    let err = restore(&req).unwrap_err().to_string();
    assert!(err.contains("sha256") && err.contains("cow.raw"), "{err}");
    assert!(
        entries(staging.path()).is_empty(),
        "{:?}",
        entries(staging.path())
    );
    // A byte planted in the memory file's hole is caught as well.
    let req = request(&cluster, root.path(), addr, staging.path(), ID);
    let mem = root.path().join(ID).join("memory-ranges");
    let mut f = std::fs::OpenOptions::new().write(true).open(&mem).unwrap();
    f.seek(SeekFrom::Start(MEM_SIZE / 2)).unwrap();
    f.write_all(b"x").unwrap();
    drop(f);
    let err = restore(&req).unwrap_err().to_string();
    assert!(err.contains("memory-ranges"), "{err}");
    assert!(entries(staging.path()).is_empty());
}

/// A manifest whose layers a raw copy cannot reproduce (zstd) is never fetched from a peer.
#[test]
fn a_snapshot_with_zstd_layers_is_not_fetched_from_a_peer() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let served = serve(&cluster, root.path(), &[("node-b", "127.0.0.1")]);
    let mut req = request(
        &cluster,
        root.path(),
        served.server.local_addr(),
        staging.path(),
        ID,
    );
    req.layers[0].media_type = "application/vnd.cocoonstack.vm.memory+zstd".into();
    let err = restore(&req).unwrap_err().to_string();
    assert!(err.contains("zstd"), "{err}");
    assert!(entries(staging.path()).is_empty());
    assert_eq!(
        served.resolved.load(Ordering::SeqCst),
        0,
        "no request was made"
    );
}

#[test]
fn a_peer_holding_another_snapshot_is_not_used() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let served = serve(&cluster, root.path(), &[("node-b", "127.0.0.1")]);
    let addr = served.server.local_addr();
    let err = restore(&request(
        &cluster,
        root.path(),
        addr,
        staging.path(),
        "01NEWERPUSH",
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("01NEWERPUSH"), "{err}");
    assert!(entries(staging.path()).is_empty());
    // A file the registry lists but the peer lacks is refused too.
    let mut req = request(&cluster, root.path(), addr, staging.path(), ID);
    req.expected
        .files
        .insert("state.json".into(), SnapshotFile::default());
    let err = restore(&req).unwrap_err().to_string();
    assert!(err.contains("state.json"), "{err}");
    assert!(entries(staging.path()).is_empty());
}

/// The source address must be the InternalIP of the Node the certificate names: from another
/// address (no node's, or another node's) it gets a 403, and a Node that moves is followed.
#[test]
fn only_a_node_at_its_own_address_is_answered() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let served = serve_with_ttls(
        &cluster,
        root.path(),
        &[("node-b", "127.0.0.2"), ("node-c", "127.0.0.3")],
        Duration::from_millis(200),
        UNKNOWN_TTL,
    );
    let addr = served.server.local_addr();
    let b = with_certificate(&cluster.node_b());
    let plan = plan_target(&digest());
    let ok = tls_get(addr, "127.0.0.2", &b, &plan);
    assert!(ok.starts_with("HTTP/1.1 200") && ok.contains(ID), "{ok}");
    // No node at 127.0.0.1: refused; the restore fails and stages nothing.
    let refused = tls_get(addr, "127.0.0.1", &b, &plan);
    assert!(
        refused.starts_with("HTTP/1.1 403") && !refused.contains(ID),
        "{refused}"
    );
    let err = restore(&request(&cluster, root.path(), addr, staging.path(), ID))
        .unwrap_err()
        .to_string();
    assert!(!err.is_empty());
    assert!(entries(staging.path()).is_empty());
    // node-b's certificate from node-c's address.
    let r = tls_get(addr, "127.0.0.3", &b, &plan);
    assert!(r.starts_with("HTTP/1.1 403") && !r.contains(ID), "{r}");
    // node-b moves to 127.0.0.1: once its lookup is older than the TTL (at most 1.5 x 200 ms),
    // its restore works there, not at .2.
    cluster.put_node("node-b", "127.0.0.1");
    std::thread::sleep(Duration::from_millis(400));
    assert!(tls_get(addr, "127.0.0.2", &b, &plan).starts_with("HTTP/1.1 403"));
    assert!(restore(&request(&cluster, root.path(), addr, staging.path(), ID)).is_ok());
}

/// A Node's InternalIP is fetched once per TTL, not per connection: a peer whose Node moves is
/// still checked against the old address until the TTL passes, then re-checked against the
/// new one, each time with one `GET nodes/node-b`.
#[test]
fn a_node_that_moves_is_rechecked_after_the_ttl() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let ttl = Duration::from_millis(800);
    let served = serve_with_ttls(
        &cluster,
        root.path(),
        &[("node-b", "127.0.0.2")],
        ttl,
        UNKNOWN_TTL,
    );
    let addr = served.server.local_addr();
    let b = with_certificate(&cluster.node_b());
    let plan = plan_target(&digest());
    let fetched_at = Instant::now();
    for _ in 0..3 {
        let r = tls_get(addr, "127.0.0.2", &b, &plan);
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    }
    assert_eq!(cluster.node_gets(), 1, "one GET for three connections");
    cluster.put_node("node-b", "127.0.0.4");
    let r = tls_get(addr, "127.0.0.2", &b, &plan);
    if fetched_at.elapsed() < ttl {
        // Within the TTL the cached address still holds.
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert_eq!(cluster.node_gets(), 1);
    }
    // Past the longest jittered TTL the Node is fetched again and the old address refused.
    std::thread::sleep((ttl + ttl / 2).saturating_sub(fetched_at.elapsed()) + ttl / 8);
    let r = tls_get(addr, "127.0.0.2", &b, &plan);
    assert!(r.starts_with("HTTP/1.1 403") && !r.contains(ID), "{r}");
    assert_eq!(cluster.node_gets(), 2);
    cluster.put_node("node-b", "127.0.0.2");
    let r = tls_get(addr, "127.0.0.2", &b, &plan);
    assert!(
        r.starts_with("HTTP/1.1 403"),
        "the move back waits for the TTL: {r}"
    );
    assert_eq!(cluster.node_gets(), 2);
}

/// A certificate naming a Node that does not exist is refused, and the name is not looked up
/// again within the negative TTL however often the caller retries; after it, once more.
#[test]
fn an_unknown_node_is_refused_and_not_refetched_within_the_negative_ttl() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let unknown_ttl = Duration::from_secs(2);
    let served = serve_with_ttls(
        &cluster,
        root.path(),
        &[("node-b", "127.0.0.2")],
        NODE_TTL,
        unknown_ttl,
    );
    let addr = served.server.local_addr();
    let ghost = with_certificate(&cluster.cert("system:node:ghost", &["vk-cocoon:nodes"]));
    let plan = plan_target(&digest());
    let first = Instant::now();
    for _ in 0..10 {
        let r = tls_get(addr, "127.0.0.2", &ghost, &plan);
        assert!(r.starts_with("HTTP/1.1 403") && !r.contains(ID), "{r}");
    }
    if first.elapsed() < unknown_ttl {
        assert_eq!(cluster.node_gets(), 1, "ten refusals, one GET");
    }
    assert_eq!(served.resolved.load(Ordering::SeqCst), 0);
    std::thread::sleep(unknown_ttl.saturating_sub(first.elapsed()) + Duration::from_millis(100));
    let gets = cluster.node_gets();
    let r = tls_get(addr, "127.0.0.2", &ghost, &plan);
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");
    assert_eq!(
        cluster.node_gets(),
        gets + 1,
        "asked again after the negative TTL"
    );
    let metrics = vk_cocoon::metrics::admission::refused_total();
    assert!(metrics.with_label_values(&["peer", "not_a_node"]).get() > 0);
}

/// A caller at a Node's address without a node's client certificate gets no byte of any
/// snapshot: no certificate or one of another CA fails the handshake; one of the cluster CA
/// that names no node, or lacks the node groups, gets 403; plain HTTP gets a 400.
#[test]
fn a_caller_without_a_node_certificate_gets_nothing() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let served = serve(&cluster, root.path(), &[("node-b", "127.0.0.1")]);
    let addr = served.server.local_addr();
    let plan = plan_target(&digest());
    let slice = slice_target("config.json", 0, MARKER.len() as u64, &digest());
    let other_ca = Cluster::new();
    for target in [&plan, &slice] {
        let r = tls_get(addr, "127.0.0.1", &without_certificate(), target);
        assert!(r.starts_with("TLS error"), "no certificate: {r}");
        let r = tls_get(
            addr,
            "127.0.0.1",
            &with_certificate(&other_ca.node_b()),
            target,
        );
        assert!(r.starts_with("TLS error"), "another CA: {r}");
        for (cn, groups) in [
            ("system:serviceaccount:evil:default", &["system:nodes"][..]),
            ("system:node:node-b", &["system:authenticated"][..]),
            ("node-b", &["vk-cocoon:nodes"][..]),
        ] {
            let pair = cluster.cert(cn, groups);
            let r = tls_get(addr, "127.0.0.1", &with_certificate(&pair), target);
            assert!(r.starts_with("HTTP/1.1 403"), "{cn} {groups:?}: {r}");
            assert!(!r.contains(ID) && !r.contains("SNAPSHOT-MARKER"), "{r}");
        }
        let r = plain_get(addr, "127.0.0.1", target);
        assert!(r.starts_with("HTTP/1.1 400") && r.contains("TLS"), "{r}");
        assert!(!r.contains(ID) && !r.contains("SNAPSHOT-MARKER"), "{r}");
    }
    // A kubelet's certificate (group system:nodes) is a node's too.
    let kubelet = cluster.cert("system:node:node-b", &["system:nodes"]);
    let r = tls_get(addr, "127.0.0.1", &with_certificate(&kubelet), &slice);
    assert!(
        r.starts_with("HTTP/1.1 200") && r.contains("SNAPSHOT-MARKER"),
        "{r}"
    );
    let metrics = vk_cocoon::metrics::admission::refused_total();
    for reason in ["not_a_node_certificate", "plain_http"] {
        assert!(
            metrics.with_label_values(&["peer", reason]).get() > 0,
            "{reason} not counted"
        );
    }
}

/// A node must name the manifest digest this node recorded when it pushed the snapshot: a
/// missing, malformed or other digest gets nothing, and nothing is read for it (the resolver
/// is not asked, no file is opened).
#[test]
fn a_node_naming_the_wrong_manifest_digest_gets_nothing() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let staging = tempfile::tempdir().unwrap();
    let served = serve(&cluster, root.path(), &[("node-b", "127.0.0.1")]);
    let addr = served.server.local_addr();
    let b = with_certificate(&cluster.node_b());
    let other = sha256_digest(b"the manifest of another tag");
    let mut refused = Vec::new();
    for d in [
        other.as_str(),
        "",
        "sha256:xyz",
        &digest().to_ascii_uppercase(),
    ] {
        refused.push(format!("/v1/snapshot-plan?name=vk-demo&digest={d}"));
        refused.push(slice_target("config.json", 0, MARKER.len() as u64, d));
    }
    refused.push("/v1/snapshot-plan?name=vk-demo".into());
    refused.push(format!(
        "/v1/snapshot-slice?id={ID}&file=config.json&offset=0&length={}",
        MARKER.len()
    ));
    // The right digest for a name this node never pushed.
    refused.push(format!(
        "/v1/snapshot-plan?name=vk-other&digest={}",
        digest()
    ));
    for target in &refused {
        let r = tls_get(addr, "127.0.0.1", &b, target);
        assert!(
            r.starts_with("HTTP/1.1 403") || r.starts_with("HTTP/1.1 404"),
            "{target}: {r}"
        );
        assert!(
            !r.contains(ID) && !r.contains("SNAPSHOT-MARKER"),
            "{target}: {r}"
        );
    }
    assert_eq!(
        served.resolved.load(Ordering::SeqCst),
        0,
        "nothing was resolved"
    );
    let mut req = request(&cluster, root.path(), addr, staging.path(), ID);
    req.manifest_digest = other;
    let err = restore(&req).unwrap_err().to_string();
    assert!(err.contains("404"), "{err}");
    assert!(entries(staging.path()).is_empty());
    // The right one is served.
    let r = tls_get(
        addr,
        "127.0.0.1",
        &b,
        &slice_target("config.json", 0, MARKER.len() as u64, &digest()),
    );
    assert!(
        r.starts_with("HTTP/1.1 200") && r.contains("SNAPSHOT-MARKER"),
        "{r}"
    );
}

#[test]
fn nothing_outside_the_pushed_snapshot_is_served() {
    let cluster = Cluster::new();
    let root = snapshot_root();
    let served = serve(&cluster, root.path(), &[("node-b", "127.0.0.1")]);
    let addr = served.server.local_addr();
    let b = with_certificate(&cluster.node_b());
    let snap = root.path().join(ID);
    std::os::unix::fs::symlink(root.path().join("secret"), snap.join("link")).unwrap();
    std::os::unix::fs::symlink(root.path(), root.path().join("up")).unwrap();
    std::fs::create_dir(root.path().join("plain")).unwrap();
    std::fs::write(root.path().join("plain/ok"), b"TOP-SECRET in a snapshot").unwrap();
    let d = digest();
    for target in [
        format!("/v1/snapshot-slice?id=..&file=secret&offset=0&length=10&digest={d}"),
        format!("/v1/snapshot-slice?id=%2E%2E&file=secret&offset=0&length=10&digest={d}"),
        format!("/v1/snapshot-slice?id={ID}&file=..%2Fsecret&offset=0&length=10&digest={d}"),
        format!("/v1/snapshot-slice?id={ID}&file=link&offset=0&length=10&digest={d}"),
        format!("/v1/snapshot-slice?id=up&file=secret&offset=0&length=10&digest={d}"),
        format!("/v1/snapshot-slice?id={ID}%2F..&file=secret&offset=0&length=10&digest={d}"),
        format!("/v1/snapshot-slice?id=/&file=etc%2Fpasswd&offset=0&length=10&digest={d}"),
        // A regular file of another snapshot directory: the digest vouches for ID only.
        format!("/v1/snapshot-slice?id=plain&file=ok&offset=0&length=10&digest={d}"),
        format!("/v1/snapshot-plan?name=..%2F..&digest={d}"),
        format!("/v1/snapshot-plan?name=-rf&digest={d}"),
        "/../secret".to_string(),
    ] {
        let r = tls_get(addr, "127.0.0.1", &b, &target);
        assert!(!r.contains("TOP-SECRET"), "{target}: {r}");
        assert!(r.starts_with("HTTP/1.1 4"), "{target}: {r}");
    }
    // The plan lists neither the symlink nor anything outside.
    let plan = tls_get(addr, "127.0.0.1", &b, &plan_target(&d));
    assert!(plan.contains("cow.raw") && !plan.contains("link"), "{plan}");
    // Beyond the end of the file.
    let r = tls_get(
        addr,
        "127.0.0.1",
        &b,
        &slice_target("config.json", 20, 10, &d),
    );
    assert!(r.starts_with("HTTP/1.1 416"), "{r}");
}

#[test]
fn the_stream_past_the_slice_stream_cap_gets_503() {
    let cluster = Cluster::new();
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join(ID)).unwrap();
    let big = std::fs::File::create(root.path().join(ID).join("mem")).unwrap();
    big.set_len(256 << 20).unwrap();
    let served = serve(&cluster, root.path(), &[("node-b", "127.0.0.1")]);
    let server = &served.server;
    let addr = server.local_addr();
    let b = with_certificate(&cluster.node_b());
    let target = slice_target("mem", 0, 256 << 20, &digest());
    // Streams whose readers do not read: each holds its slot while the server is blocked.
    let held: Vec<_> = (0..MAX_SLICE_STREAMS)
        .map(|_| {
            let sock = connect_with(addr, "127.0.0.1", Some(4096));
            tls_request_over(sock, &b, &target).unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.slice_streams() < MAX_SLICE_STREAMS {
        assert!(
            Instant::now() < deadline,
            "only {} streams",
            server.slice_streams()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = tls_get(addr, "127.0.0.1", &b, &target);
    assert!(r.starts_with("HTTP/1.1 503"), "{}", &r[..r.len().min(200)]);
    assert!(r.contains("Retry-After"));
    // A plan is still answered while the slice streams are busy.
    let plan = tls_get(addr, "127.0.0.1", &b, &plan_target(&digest()));
    assert!(plan.starts_with("HTTP/1.1 200"), "{plan}");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.slice_streams() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} streams left",
            server.slice_streams()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let ok = tls_get(
        addr,
        "127.0.0.1",
        &b,
        &slice_target("mem", 0, 16, &digest()),
    );
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
}
