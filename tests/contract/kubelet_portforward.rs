//! Port-forward through the kubelet API over WebSocket channel pairs (tungstenite as the
//! client): bytes reach a TCP service on the pod's VM address and come back, the port is
//! announced on both channels, failures arrive on the error channel, callers without rights
//! never reach the guest, and a client that does not read stops the guest instead of growing
//! the daemon's buffers. kubectl's own transports (SPDY, tunnelled SPDY) are exercised with the
//! real kubectl in the process tests.

use crate::kubelet_support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::PodStatus;
use kubelet_support::{pod, Harness, Options};
use rustls::{ClientConnection, StreamOwned};
use tungstenite::client::IntoClientRequest;
use tungstenite::Message;
use vk_cocoon::kubelet::PodInfo;

type Tls = StreamOwned<ClientConnection, TcpStream>;

/// The guest's address in these tests (any 127/8 address is the local host).
const GUEST_IP: &str = "127.0.0.77";

fn with_ip(mut p: PodInfo, ip: &str) -> PodInfo {
    p.status = Some(Arc::new(PodStatus {
        pod_ip: Some(ip.into()),
        ..Default::default()
    }));
    p
}

fn harness() -> Harness {
    Harness::start(Options {
        pods: vec![
            with_ip(pod("ns1", "web", Some(("vm-web", 0))), GUEST_IP),
            // Created, its VM not yet given an address (DHCP lease pending).
            pod("ns1", "early", Some(("vm-early", 0))),
        ],
        ..Default::default()
    })
}

/// A TCP service in the guest; `serve` runs on each accepted connection.
fn guest(serve: fn(TcpStream)) -> (u16, Arc<AtomicUsize>) {
    let l = TcpListener::bind((GUEST_IP, 0)).expect("listen on the guest's address");
    let port = l.local_addr().expect("bound").port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for c in l.incoming().map_while(Result::ok) {
            count.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || serve(c));
        }
    });
    (port, accepted)
}

fn echo(mut c: TcpStream) {
    let mut buf = [0u8; 64 * 1024];
    while let Ok(n) = c.read(&mut buf) {
        if n == 0 || c.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = c.shutdown(Shutdown::Write);
}

fn ws_forward(
    h: &Harness,
    pod: &str,
    ports: &str,
    token: &str,
) -> Result<tungstenite::WebSocket<Tls>, String> {
    let s = h.connect(h.client_config(None, &h.pki.ca_pem)).unwrap();
    let mut req = format!("wss://localhost/portForward/ns1/{pod}?{ports}")
        .into_client_request()
        .unwrap();
    req.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        "v4.channel.k8s.io".parse().unwrap(),
    );
    req.headers_mut()
        .insert("Authorization", format!("Bearer {token}").parse().unwrap());
    // Err: the HTTP status of a refused upgrade, or the error.
    match tungstenite::client::client(req, s) {
        Ok((ws, _)) => Ok(ws),
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(r))) => {
            Err(r.status().as_u16().to_string())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// The next binary message: (channel, payload).
fn next(ws: &mut tungstenite::WebSocket<Tls>) -> Option<(u8, Vec<u8>)> {
    loop {
        let m = match ws.read() {
            Ok(m) => m,
            Err(e) => {
                eprintln!("forward read: {e}");
                return None;
            }
        };
        match m {
            Message::Binary(b) if !b.is_empty() => return Some((b[0], b[1..].to_vec())),
            Message::Close(_) => return None,
            _ => {}
        }
    }
}

#[test]
fn websocket_channels_carry_bytes_both_ways_and_report_failures() {
    let h = harness();
    let (port, accepted) = guest(echo);
    let closed = TcpListener::bind((GUEST_IP, 0))
        .and_then(|l| l.local_addr())
        .expect("a port")
        .port();
    let mut ws = ws_forward(
        &h,
        "web",
        &format!("port={port}&port={closed}"),
        "admin-token",
    )
    .expect("upgrade");
    // Each port is announced on its data and error channel as a little-endian u16.
    let mut announced = Vec::new();
    for _ in 0..4 {
        announced.push(next(&mut ws).expect("announcement"));
    }
    for (i, p) in [port, closed].iter().enumerate() {
        for ch in [2 * i as u8, 2 * i as u8 + 1] {
            assert!(
                announced.contains(&(ch, p.to_le_bytes().to_vec())),
                "channel {ch}: {announced:?}"
            );
        }
    }
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    for piece in data.chunks(10_000) {
        ws.send(Message::Binary([&[0u8][..], piece].concat().into()))
            .unwrap();
    }
    let mut back = Vec::new();
    let mut refused = String::new();
    while back.len() < data.len() || refused.is_empty() {
        match next(&mut ws).expect("more from the forward") {
            (0, b) => back.extend_from_slice(&b),
            (3, m) => refused = String::from_utf8_lossy(&m).into_owned(),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(back == data, "{} bytes came back", back.len());
    assert_eq!(
        refused,
        format!("error forwarding port {closed} to pod ns1/web, uid uid-web: dial tcp {GUEST_IP}:{closed}: connect: connection refused")
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    drop(ws);

    // A VM with no address yet: said on the error channel, nothing dialled.
    let mut ws = ws_forward(&h, "early", "port=22", "admin-token").expect("upgrade");
    let mut msgs = Vec::new();
    while let Some(m) = next(&mut ws) {
        msgs.push(m);
    }
    assert!(
        msgs.contains(&(
            1,
            b"error forwarding port 22 to pod ns1/early, uid uid-early: the pod's VM has no IP address yet".to_vec()
        )),
        "{msgs:?}"
    );
    // Ports out of range are refused before any upgrade.
    for bad in ["port=0", "port=65536", "port=ssh", ""] {
        match ws_forward(&h, "web", bad, "admin-token") {
            Err(status) => assert_eq!(status, "400", "{bad}"),
            Ok(_) => panic!("{bad}: upgraded"),
        }
    }
    let c = h.wait_idle();
    assert_eq!((c.connections, c.guests), (0, 0), "nothing leaked: {c:?}");
}

#[test]
fn callers_without_rights_never_reach_the_guest() {
    let h = harness();
    let (port, accepted) = guest(echo);
    for token in ["stats-token", "forged"] {
        match ws_forward(&h, "web", &format!("port={port}"), token) {
            Err(status) => {
                let want = if token == "forged" { "401" } else { "403" };
                assert_eq!(status, want, "{token}");
            }
            Ok(_) => panic!("{token}: upgraded"),
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(accepted.load(Ordering::SeqCst), 0);
    let c = h.wait_idle();
    assert_eq!((c.connections, c.guests), (0, 0), "nothing leaked: {c:?}");
}

/// How many bytes the guest's writer got out while nobody read the forward.
static WRITTEN: AtomicUsize = AtomicUsize::new(0);
const FLOOD: usize = 64 * 1024 * 1024;

fn flood(mut c: TcpStream) {
    let chunk = [7u8; 64 * 1024];
    while WRITTEN.load(Ordering::SeqCst) < FLOOD {
        if c.write_all(&chunk).is_err() {
            return;
        }
        WRITTEN.fetch_add(chunk.len(), Ordering::SeqCst);
    }
}

#[test]
fn a_client_that_does_not_read_stops_the_guest_not_the_daemon() {
    let h = harness();
    let (port, _) = guest(flood);
    let mut ws = ws_forward(&h, "web", &format!("port={port}"), "admin-token").expect("upgrade");
    // Nobody reads: the guest's writes stall once the bounded buffers on the way are full.
    std::thread::sleep(Duration::from_secs(3));
    let stalled = WRITTEN.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        WRITTEN.load(Ordering::SeqCst),
        stalled,
        "the guest keeps writing while nobody reads"
    );
    // What the kernel's socket buffers on both sides hold, plus the daemon's bounded backlog.
    assert!(
        stalled < 40 * 1024 * 1024,
        "{stalled} bytes left the guest while nobody read"
    );
    // Reading again lets everything through, in order and complete.
    let started = Instant::now();
    let deadline = started + Duration::from_secs(120);
    let mut got = 0usize;
    while got < FLOOD {
        assert!(Instant::now() < deadline, "only {got} bytes arrived");
        let Some(m) = next(&mut ws) else {
            panic!("the forward ended after {got} of {FLOOD} bytes");
        };
        match m {
            (0, b) if got == 0 && b.len() == 2 => {
                // The port announcement, not guest bytes.
                assert_eq!(b, port.to_le_bytes());
            }
            (0, b) => {
                assert!(b.iter().all(|x| *x == 7));
                got += b.len();
            }
            _ => {}
        }
    }
    assert_eq!(got, FLOOD);
    println!(
        "stalled after {stalled} bytes of {FLOOD}; all read in {:?}",
        started.elapsed()
    );
}
