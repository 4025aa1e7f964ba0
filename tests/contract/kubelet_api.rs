//! The kubelet API over real TLS: authentication and authorisation on every route, the plain
//! routes, stats against real /proc, containerLogs (tail, limit, timestamps, follow), bad input.

use crate::kubelet_support;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use kubelet_support::{pod, promtool_check, Harness, Options, Sleeper};
use vk_cocoon::kubelet::stats::Summary;

const ROUTES: [(&str, &str); 14] = [
    ("GET", "/healthz"),
    ("GET", "/pods"),
    ("GET", "/runningpods/"),
    ("GET", "/stats/summary"),
    ("GET", "/metrics/resource"),
    ("GET", "/metrics"),
    ("GET", "/metrics/cadvisor"),
    ("GET", "/metrics/probes"),
    ("GET", "/containerLogs/ns1/web/agent"),
    ("POST", "/exec/ns1/web/agent?command=true&output=1"),
    ("POST", "/attach/ns1/web/agent?output=1"),
    ("POST", "/portForward/ns1/web"),
    ("GET", "/configz"),
    ("GET", "/nonexistent/route"),
];

fn bearer(t: &str) -> String {
    format!("Bearer {t}")
}

#[test]
fn callers_without_rights_are_refused_on_every_route() {
    let h = Harness::start(Options {
        pods: vec![pod("ns1", "web", Some(("vm-web", 0)))],
        ..Default::default()
    });
    let anon = h.client_config(None, &h.pki.ca_pem);
    let cert_ok = h
        .pki
        .issue("kube-apiserver-kubelet-client", &["system:masters"], false);
    let cert_nobody = h.pki.issue("nobody", &["developers"], false);
    let other_ca = kubelet_support::Pki::new("some-other-ca");
    let cert_wrong_ca = other_ca.issue("kube-apiserver-kubelet-client", &["system:masters"], false);
    let nobody = h.client_config(Some(&cert_nobody), &h.pki.ca_pem);
    let admin_cert = h.client_config(Some(&cert_ok), &h.pki.ca_pem);
    let wrong_ca = h.client_config(Some(&cert_wrong_ca), &h.pki.ca_pem);
    for (method, path) in ROUTES {
        let r = h.request(anon.clone(), method, path, &[]).unwrap();
        assert_eq!(
            r.status,
            401,
            "{method} {path} without credentials: {}",
            r.text()
        );
        let r = h
            .request(
                anon.clone(),
                method,
                path,
                &[("Authorization", &bearer("forged"))],
            )
            .unwrap();
        assert_eq!(r.status, 401, "{method} {path} with an unknown token");
        let r = h.request(nobody.clone(), method, path, &[]).unwrap();
        assert_eq!(
            r.status, 403,
            "{method} {path} with a certificate user without rights"
        );
        let r = h
            .request(
                anon.clone(),
                method,
                path,
                &[("Authorization", &bearer("broken-token"))],
            )
            .unwrap();
        assert_eq!(r.status, 500, "{method} {path} when the TokenReview fails");
        assert!(
            !r.text().contains("connection refused"),
            "the API server's error text stays in the log: {}",
            r.text()
        );
        // A certificate from another CA does not get through the handshake at all.
        let refused = h.request(wrong_ca.clone(), method, path, &[]);
        assert!(
            refused.is_err(),
            "{method} {path} with a wrong-CA certificate: {refused:?}"
        );
    }
    // metrics-server's token may read stats and metrics but nothing else.
    let stats_only = [("Authorization", bearer("stats-token"))];
    let hdr: Vec<(&str, &str)> = stats_only.iter().map(|(k, v)| (*k, v.as_str())).collect();
    assert_eq!(
        h.request(anon.clone(), "GET", "/stats/summary", &hdr)
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        h.request(anon.clone(), "GET", "/metrics/resource", &hdr)
            .unwrap()
            .status,
        200
    );
    for path in ["/metrics", "/metrics/cadvisor", "/metrics/probes"] {
        assert_eq!(
            h.request(anon.clone(), "GET", path, &hdr).unwrap().status,
            200,
            "{path} is nodes/metrics"
        );
    }
    assert_eq!(
        h.request(anon.clone(), "GET", "/pods", &hdr)
            .unwrap()
            .status,
        403
    );
    assert_eq!(
        h.request(anon.clone(), "GET", "/containerLogs/ns1/web/agent", &hdr)
            .unwrap()
            .status,
        403
    );
    // The API server's client certificate passes.
    let r = h.request(admin_cert, "GET", "/healthz", &[]).unwrap();
    assert_eq!((r.status, r.text().as_str()), (200, "ok"));
    let c = h.wait_idle();
    assert_eq!((c.connections, c.children), (0, 0), "nothing leaked: {c:?}");
}

/// cocoon-macos has no exec or console log: a macOS guest's logs and exec are refused with a
/// message that says so (not cocoon's "vm not found" for an id it never had).
#[test]
fn a_macos_guests_logs_and_exec_are_refused_plainly() {
    let mut mac = pod("ns1", "mac", Some(("qemu-vk-ns1-mac", 0)));
    if let Some(vm) = mac.vm.as_mut() {
        vm.backend = "qemu".into();
    }
    let h = Harness::start(Options {
        pods: vec![mac],
        ..Default::default()
    });
    let cfg = h.client_config(None, &h.pki.ca_pem);
    let auth = bearer("admin-token");
    let logs = h
        .request(
            cfg.clone(),
            "GET",
            "/containerLogs/ns1/mac/agent",
            &[("Authorization", &auth)],
        )
        .unwrap();
    assert_eq!(logs.status, 400);
    assert!(
        logs.text()
            .contains("logs is not available for macOS guests"),
        "{}",
        logs.text()
    );
    let exec = h
        .request(
            cfg,
            "POST",
            "/exec/ns1/mac/agent?command=true&output=1",
            &[
                ("Authorization", &auth),
                ("Connection", "Upgrade"),
                ("Upgrade", "SPDY/3.1"),
                ("X-Stream-Protocol-Version", "v4.channel.k8s.io"),
            ],
        )
        .unwrap();
    assert_eq!(exec.status, 400);
    assert!(
        exec.text()
            .contains("exec is not available for macOS guests"),
        "{}",
        exec.text()
    );
}

#[test]
fn open_mode_serves_without_credentials() {
    let h = Harness::start(Options {
        auth: false,
        ..Default::default()
    });
    let anon = h.client_config(None, &h.pki.ca_pem);
    assert_eq!(h.request(anon, "GET", "/healthz", &[]).unwrap().status, 200);
}

#[test]
fn plain_routes_and_stats_match_proc() {
    let sleeper = Sleeper::start();
    let pid = sleeper.pid();
    let h = Harness::start(Options {
        pods: vec![
            pod("ns1", "web", Some(("vm-web", pid))),
            pod("ns1", "cold", None),
            pod("ns2", "db", Some(("vm-db", pid))),
        ],
        ..Default::default()
    });
    let cfg = h.client_config(None, &h.pki.ca_pem);
    let auth = bearer("admin-token");
    let a = [("Authorization", auth.as_str())];

    let pods: serde_json::Value =
        serde_json::from_slice(&h.request(cfg.clone(), "GET", "/pods", &a).unwrap().body).unwrap();
    assert_eq!(pods["kind"], "PodList");
    assert_eq!(pods["items"].as_array().unwrap().len(), 3);
    let running: serde_json::Value = serde_json::from_slice(
        &h.request(cfg.clone(), "GET", "/runningpods/", &a)
            .unwrap()
            .body,
    )
    .unwrap();
    let names: Vec<&str> = running["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["web", "db"]);

    let r = h.request(cfg.clone(), "GET", "/stats/summary", &a).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let summary: Summary = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(summary.node.node_name, "node-1");
    assert_eq!(summary.pods.len(), 2);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rss_pages: u64 = stat[stat.rfind(')').unwrap() + 2..]
        .split(' ')
        .nth(21)
        .unwrap()
        .parse()
        .unwrap();
    let ws = summary.pods[0].containers[0]
        .memory
        .as_ref()
        .unwrap()
        .working_set_bytes
        .unwrap();
    // The sleeping child's RSS is settled by now; allow for the kernel's per-cpu counter slack.
    assert!(
        ws.abs_diff(rss_pages * procfs::page_size()) <= 64 * 4096,
        "{ws} vs {rss_pages} pages"
    );
    let again = h
        .request(cfg.clone(), "GET", "/stats/summary/", &a)
        .unwrap();
    assert_eq!(again.status, 200, "trailing-slash twin");

    let m = h
        .request(cfg.clone(), "GET", "/metrics/resource", &a)
        .unwrap();
    assert_eq!(m.header("content-type"), Some("text/plain; version=0.0.4"));
    let text = m.text();
    assert!(
        text.contains("pod_memory_working_set_bytes{namespace=\"ns2\",pod=\"db\"}"),
        "{text}"
    );
    promtool_check(&text);

    let nf = h.request(cfg.clone(), "GET", "/configz", &a).unwrap();
    assert_eq!(
        (nf.status, nf.text().as_str()),
        (404, "404 request not found")
    );
    assert_eq!(
        h.request(cfg.clone(), "DELETE", "/pods", &a)
            .unwrap()
            .status,
        405
    );
    // Port forwarding needs an upgrade to a stream protocol; a plain request is told so.
    let pf = h
        .request(cfg.clone(), "POST", "/portForward/ns1/web", &a)
        .unwrap();
    assert_eq!(pf.status, 400);
    assert!(pf.text().contains("unable to upgrade"), "{}", pf.text());
    // The pod's own container name (whatever its spec calls it) reaches the VM's logs, as
    // with the Go daemon, which ignores the name.
    let own_name = h
        .request(cfg.clone(), "GET", "/containerLogs/ns1/cold/sidecar", &a)
        .unwrap();
    assert_eq!(
        (own_name.status, own_name.text().as_str()),
        (200, "vk-cocoon: pod has no live VM\n")
    );
    assert_eq!(
        h.request(cfg.clone(), "GET", "/containerLogs/ns1/ghost/agent", &a)
            .unwrap()
            .status,
        404
    );
    let cold = h
        .request(cfg.clone(), "GET", "/containerLogs/ns1/cold/agent", &a)
        .unwrap();
    assert_eq!(
        (cold.status, cold.text().as_str()),
        (200, "vk-cocoon: pod has no live VM\n")
    );
    assert_eq!(
        h.request(cfg, "GET", "/containerLogs/ns1/web/agent?tailLines=x", &a)
            .unwrap()
            .status,
        400
    );
    let c = h.wait_idle();
    assert_eq!(
        (c.connections, c.children, c.reactor_children),
        (0, 0, 0),
        "{c:?}"
    );
}

#[test]
fn container_logs_tail_limit_timestamps_and_follow() {
    let h = Harness::start(Options {
        pods: vec![
            pod("ns1", "web", Some(("vm-web", 0))),
            pod("ns1", "new", Some(("vm-new", 0))),
        ],
        ..Default::default()
    });
    let log = h.log_dir.join("vm-web.log");
    std::fs::write(&log, "line1\nline2\nline3\nline4\n").unwrap();
    let cfg = h.client_config(None, &h.pki.ca_pem);
    let auth = bearer("admin-token");
    let a = [("Authorization", auth.as_str())];
    let all = h
        .request(cfg.clone(), "GET", "/containerLogs/ns1/web/agent", &a)
        .unwrap();
    assert_eq!(
        (all.status, all.text().as_str()),
        (200, "line1\nline2\nline3\nline4\n")
    );
    assert_eq!(
        all.header("content-type"),
        Some("text/plain; charset=utf-8")
    );
    let tail = h
        .request(
            cfg.clone(),
            "GET",
            "/containerLogs/ns1/web/agent?tailLines=2",
            &a,
        )
        .unwrap();
    assert_eq!(tail.text(), "line3\nline4\n");
    let limited = h
        .request(
            cfg.clone(),
            "GET",
            "/containerLogs/ns1/web/agent?limitBytes=8",
            &a,
        )
        .unwrap();
    assert_eq!(limited.text(), "line1\nli");
    let stamped = h
        .request(
            cfg.clone(),
            "GET",
            "/containerLogs/ns1/web/agent?tailLines=1&timestamps=true",
            &a,
        )
        .unwrap();
    let line = stamped.text();
    let (ts, rest) = line.split_once(' ').unwrap();
    assert_eq!(rest, "line4\n");
    assert!(
        ts.ends_with('Z') && ts.len() >= 20 && ts.as_bytes()[10] == b'T',
        "{ts}"
    );
    // A VM whose log does not exist yet: cocoon's error is passed on.
    let missing = h
        .request(cfg.clone(), "GET", "/containerLogs/ns1/new/agent", &a)
        .unwrap();
    assert_eq!(missing.status, 500);
    assert!(
        missing.text().contains("VM may not have been started yet"),
        "{}",
        missing.text()
    );

    // follow: the stream stays open and delivers lines appended later.
    let mut s = h.connect(cfg.clone()).unwrap();
    s.write_all(format!("GET /containerLogs/ns1/web/agent?tailLines=1&follow=true HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n").as_bytes()).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let wait_for = |s: &mut rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>,
                    got: &mut Vec<u8>,
                    buf: &mut [u8],
                    needle: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !String::from_utf8_lossy(got).contains(needle) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {needle:?} in {:?}",
                String::from_utf8_lossy(got)
            );
            let n = s.read(buf).unwrap();
            assert!(n > 0, "stream ended early");
            got.extend_from_slice(&buf[..n]);
        }
    };
    wait_for(&mut s, &mut got, &mut buf, "line4\n");
    std::fs::OpenOptions::new()
        .append(true)
        .open(&log)
        .unwrap()
        .write_all(b"line5 appended\n")
        .unwrap();
    wait_for(&mut s, &mut got, &mut buf, "line5 appended\n");
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200 OK"));
    assert_eq!(
        h.counters().children,
        1,
        "the follow child runs while the client listens"
    );
    drop(s);
    // Client gone: the follow child is killed and reaped.
    let c = h.wait_idle();
    assert_eq!(
        (c.connections, c.children, c.reactor_children),
        (0, 0, 0),
        "{c:?}"
    );
}

#[test]
fn bad_input_gets_errors_and_the_loop_keeps_serving() {
    let h = Harness::start(Options {
        pods: vec![pod("ns1", "web", Some(("vm-web", 0)))],
        ..Default::default()
    });
    let cfg = h.client_config(None, &h.pki.ca_pem);
    let auth = bearer("admin-token");
    let raw = |bytes: &[u8]| -> kubelet_support::Response {
        let mut s = h.connect(cfg.clone()).unwrap();
        s.write_all(bytes).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        kubelet_support::Response::parse(&out)
            .unwrap_or_else(|| panic!("no response: {:?}", String::from_utf8_lossy(&out)))
    };
    assert_eq!(raw(b"\x16\x03garbage\r\n\r\n").status, 400);
    assert_eq!(raw(b"GET http://evil/ HTTP/1.1\r\n\r\n").status, 400);
    let mut flood = b"GET /healthz HTTP/1.1\r\n".to_vec();
    for i in 0..500 {
        flood.extend_from_slice(format!("X-Flood-{i}: v\r\n").as_bytes());
    }
    flood.extend_from_slice(b"\r\n");
    assert_eq!(raw(&flood).status, 431);
    let mut huge = b"GET /healthz HTTP/1.1\r\nX-Big: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 40 * 1024));
    assert_eq!(raw(&huge).status, 431);
    assert_eq!(
        raw(b"POST /healthz HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody").status,
        413
    );
    // Unknown remote-command protocol versions.
    let spdy = format!("POST /exec/ns1/web/agent?command=true&output=1 HTTP/1.1\r\nAuthorization: {auth}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v9.channel.k8s.io\r\n\r\n");
    assert_eq!(raw(spdy.as_bytes()).status, 403);
    let no_version = format!("POST /exec/ns1/web/agent?command=true&output=1 HTTP/1.1\r\nAuthorization: {auth}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\n");
    let r = raw(no_version.as_bytes());
    assert_eq!(
        (r.status, r.text().as_str()),
        (
            400,
            "unable to upgrade: X-Stream-Protocol-Version is required"
        )
    );
    let ws = format!("GET /exec/ns1/web/agent?command=true&output=1 HTTP/1.1\r\nAuthorization: {auth}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: v99.channel.k8s.io\r\n\r\n");
    assert_eq!(raw(ws.as_bytes()).status, 400);
    // A client that connects and stays silent, and one that sends half a head, do not block others.
    let _silent = std::net::TcpStream::connect(h.addr).unwrap();
    let mut half = h.connect(cfg.clone()).unwrap();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHost:").unwrap();
    let ok = h
        .request(cfg.clone(), "GET", "/healthz", &[("Authorization", &auth)])
        .unwrap();
    assert_eq!(ok.status, 200);
    // Keep-alive: two requests on one connection.
    let mut s = h.connect(cfg.clone()).unwrap();
    s.write_all(format!("GET /healthz HTTP/1.1\r\nAuthorization: {auth}\r\n\r\nGET /healthz HTTP/1.1\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n").as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert_eq!(
        String::from_utf8_lossy(&out)
            .matches("HTTP/1.1 200 OK")
            .count(),
        2
    );
    drop(half);
    drop(_silent);
    let c = h.wait_idle();
    assert_eq!((c.connections, c.children), (0, 0), "{c:?}");
}

#[test]
fn idle_and_half_sent_requests_time_out() {
    // Both clients present no certificate, so the unauthenticated deadline is the one that
    // applies; it is shortened too, well below the silent client's 5 s read timeout (at the
    // default 5 s the two raced).
    let h = Harness::start(Options {
        tweak: |c| {
            c.head_timeout = Duration::from_millis(300);
            c.unauthenticated_timeout = Duration::from_millis(300);
        },
        ..Default::default()
    });
    let cfg = h.client_config(None, &h.pki.ca_pem);
    let mut half = h.connect(cfg.clone()).unwrap();
    half.write_all(b"GET /healthz HTTP/1.1\r\n").unwrap();
    let mut out = Vec::new();
    let _ = half.read_to_end(&mut out);
    let r = kubelet_support::Response::parse(&out).unwrap();
    assert_eq!(r.status, 408);
    let silent = std::net::TcpStream::connect(h.addr).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut b = [0u8; 1];
    assert_eq!(
        (&silent).read(&mut b).unwrap(),
        0,
        "silent connection closed by the server"
    );
    assert_eq!(h.wait_idle().connections, 0);
}

/// Waits (bounded) until the harness counters satisfy `f`.
fn wait_counters(h: &Harness, what: &str, f: impl Fn(&kubelet_support::Counters) -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f(&h.counters()) {
        assert!(
            Instant::now() < end,
            "timed out waiting for {what}: {:?}",
            h.counters()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn reviews_in_flight_per_address_are_capped_and_dropped_when_the_client_leaves() {
    let h = Harness::start(Options::default());
    let anon = h.client_config(None, &h.pki.ca_pem);
    let held_request =
        "GET /pods HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer held-token\r\n\r\n";
    // Four reviews wait on a slow API server: the per-address cap.
    let mut waiting = Vec::new();
    for _ in 0..4 {
        let mut s = h.connect(anon.clone()).unwrap();
        s.write_all(held_request.as_bytes()).unwrap();
        s.flush().unwrap();
        waiting.push(s);
    }
    wait_counters(&h, "four held reviews", |c| c.held_reviews == 4);
    // A fifth from the same address is turned away before any review.
    let r = h
        .request(
            anon.clone(),
            "GET",
            "/pods",
            &[("Authorization", &bearer("forged"))],
        )
        .unwrap();
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(h.counters().held_reviews, 4);
    // The clients leave: their reviews are given up and the budget comes back.
    drop(waiting);
    wait_counters(&h, "reviews cancelled", |c| {
        c.cancelled_reviews == 4 && c.held_reviews == 0
    });
    let r = h
        .request(
            anon.clone(),
            "GET",
            "/pods",
            &[("Authorization", &bearer("forged"))],
        )
        .unwrap();
    assert_eq!(r.status, 401, "{}", r.text());
}
