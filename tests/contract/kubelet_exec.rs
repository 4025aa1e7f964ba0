//! exec and attach through the kubelet API over both transports: a WebSocket client (tungstenite)
//! and a SPDY/3.1 client written here from the protocol description (framing, zlib header blocks
//! with the SPDY/3 dictionary). stdin reaches the command, stdout comes back, the exit status
//! arrives on the error channel; protocol abuse and sends after close leave nothing behind.

use crate::kubelet_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress};
use kubelet_support::{pod, Harness, Options};
use rustls::{ClientConnection, StreamOwned};
use tungstenite::client::IntoClientRequest;
use tungstenite::Message;

type Tls = StreamOwned<ClientConnection, TcpStream>;

fn harness() -> Harness {
    Harness::start(Options {
        pods: vec![
            pod("ns1", "web", Some(("vm-web", 0))),
            pod("ns1", "cold", None),
        ],
        ..Default::default()
    })
}

// ----- WebSocket --------------------------------------------------------------------------

fn ws_connect(h: &Harness, query: &str, protocol: &str) -> tungstenite::WebSocket<Tls> {
    let s = h.connect(h.client_config(None, &h.pki.ca_pem)).unwrap();
    let mut req = format!("wss://localhost/exec/ns1/web/agent?{query}")
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", protocol.parse().unwrap());
    req.headers_mut()
        .insert("Authorization", "Bearer admin-token".parse().unwrap());
    let (ws, resp) = tungstenite::client::client(req, s).unwrap();
    assert_eq!(
        resp.headers().get("sec-websocket-protocol").unwrap(),
        protocol
    );
    ws
}

/// Reads until the error channel speaks; returns (stdout, stderr, error message).
fn ws_collect(ws: &mut tungstenite::WebSocket<Tls>) -> (Vec<u8>, Vec<u8>, String) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        match ws.read().unwrap() {
            Message::Binary(b) => match b.first() {
                Some(1) => out.extend_from_slice(&b[1..]),
                Some(2) => err.extend_from_slice(&b[1..]),
                Some(3) => return (out, err, String::from_utf8_lossy(&b[1..]).into_owned()),
                _ => {}
            },
            Message::Close(_) => return (out, err, String::new()),
            _ => {}
        }
    }
}

#[test]
fn websocket_exec_stdin_stdout_and_exit_status() {
    let h = harness();
    let mut ws = ws_connect(
        &h,
        "command=cat&input=1&output=1&error=1",
        "v5.channel.k8s.io",
    );
    // The server announces the session with an empty stdout message.
    assert_eq!(ws.read().unwrap(), Message::Binary(vec![1u8].into()));
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let mut msg = vec![0u8];
    msg.extend_from_slice(&payload);
    ws.send(Message::Binary(msg.into())).unwrap();
    // v5: close stdin (channel 255, stream 0) so cat sees EOF and exits.
    ws.send(Message::Binary(vec![255u8, 0].into())).unwrap();
    let (out, err, status) = ws_collect(&mut ws);
    assert_eq!(out.len(), payload.len());
    assert!(out == payload, "stdout is stdin");
    assert!(err.is_empty());
    let st: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(st["status"], "Success");
    drop(ws);

    let mut ws = ws_connect(
        &h,
        "command=perl&command=-e&command=print+STDERR+%22oops%22%3B+exit+3&output=1&error=1",
        "v4.channel.k8s.io",
    );
    let (out, err, status) = ws_collect(&mut ws);
    assert!(out.is_empty());
    assert_eq!(err, b"oops");
    let st: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(st["status"], "Failure");
    assert_eq!(st["reason"], "NonZeroExitCode");
    assert_eq!(st["details"]["causes"][0]["reason"], "ExitCode");
    assert_eq!(st["details"]["causes"][0]["message"], "3");
    drop(ws);

    // base64 variant: text frames, channel as an ASCII digit.
    let mut ws = ws_connect(
        &h,
        "command=echo&command=b64&output=1",
        "v4.base64.channel.k8s.io",
    );
    let mut got = String::new();
    loop {
        match ws.read().unwrap() {
            // Each message is encoded on its own; the empty opening message adds nothing.
            Message::Text(t) if t.starts_with('1') => got.push_str(&t[1..]),
            Message::Text(t) if t.starts_with('3') => break,
            Message::Close(_) => break,
            _ => {}
        }
    }
    use base64::Engine;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(got.as_bytes())
        .unwrap();
    assert_eq!(decoded, b"b64\n");
    drop(ws);
    let c = h.wait_idle();
    assert_eq!(
        (c.connections, c.children, c.reactor_children),
        (0, 0, 0),
        "{c:?}"
    );
}

#[test]
fn websocket_client_leaving_mid_exec_kills_the_child() {
    let h = harness();
    let mut ws = ws_connect(
        &h,
        "command=sleep&command=600&output=1",
        "v4.channel.k8s.io",
    );
    assert_eq!(ws.read().unwrap(), Message::Binary(vec![1u8].into()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.counters().reactor_children != 1 {
        assert!(Instant::now() < deadline, "exec child never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(ws);
    let c = h.wait_idle();
    assert_eq!(
        (c.connections, c.children, c.reactor_children),
        (0, 0, 0),
        "{c:?}"
    );
}

// ----- SPDY/3.1 client, built here from the protocol description --------------------------

fn spdy_dictionary() -> Vec<u8> {
    let words = "options head post put delete trace accept accept-charset accept-encoding accept-language accept-ranges age allow authorization cache-control connection content-base content-encoding content-language content-length content-location content-md5 content-range content-type date etag expect expires from host if-match if-modified-since if-none-match if-range if-unmodified-since last-modified location max-forwards pragma proxy-authenticate proxy-authorization range referer retry-after server te trailer transfer-encoding upgrade user-agent vary via warning www-authenticate method get status 200_OK version HTTP/1.1 url public set-cookie keep-alive origin";
    let mut d = Vec::new();
    for w in words.split(' ') {
        let w = w.replace('_', " ");
        d.extend_from_slice(&(w.len() as u32).to_be_bytes());
        d.extend_from_slice(w.as_bytes());
    }
    d.extend_from_slice(b"100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505");
    d.extend_from_slice(b"203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented503 Service Unavailable");
    d.extend_from_slice(b"Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT");
    d.extend_from_slice(b"chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.");
    assert_eq!(d.len(), 1423);
    d
}

struct SpdyClient {
    s: Tls,
    deflate: Compress,
    inflate: Decompress,
    dict: Vec<u8>,
    buf: Vec<u8>,
}

#[derive(Debug)]
enum Frame {
    Control {
        kind: u16,
        payload: Vec<u8>,
    },
    Data {
        stream: u32,
        flags: u8,
        payload: Vec<u8>,
    },
}

impl SpdyClient {
    fn upgrade(
        h: &Harness,
        path_query: &str,
        versions: &str,
    ) -> Result<(SpdyClient, String), String> {
        let mut s = h.connect(h.client_config(None, &h.pki.ca_pem)).unwrap();
        let req = format!(
            "POST {path_query} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer admin-token\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: {versions}\r\nContent-Length: 0\r\n\r\n"
        );
        s.write_all(req.as_bytes()).unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if s.read(&mut b).unwrap() == 0 {
                break;
            }
            head.push(b[0]);
        }
        let text = String::from_utf8_lossy(&head).into_owned();
        if !text.starts_with("HTTP/1.1 101") {
            return Err(text);
        }
        let version = text
            .lines()
            .find_map(|l| l.strip_prefix("X-Stream-Protocol-Version: "))
            .unwrap_or("")
            .trim()
            .to_string();
        let dict = spdy_dictionary();
        let mut deflate = Compress::new(Compression::default(), true);
        deflate.set_dictionary(&dict).unwrap();
        Ok((
            SpdyClient {
                s,
                deflate,
                inflate: Decompress::new(true),
                dict,
                buf: Vec::new(),
            },
            version,
        ))
    }

    fn control(&mut self, kind: u16, flags: u8, payload: &[u8]) -> std::io::Result<()> {
        let mut f = vec![0x80, 3];
        f.extend_from_slice(&kind.to_be_bytes());
        f.push(flags);
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
        f.extend_from_slice(payload);
        self.s.write_all(&f)
    }

    fn syn_stream(&mut self, id: u32, stream_type: &str) {
        let mut block = 1u32.to_be_bytes().to_vec();
        for v in ["streamtype", stream_type] {
            block.extend_from_slice(&(v.len() as u32).to_be_bytes());
            block.extend_from_slice(v.as_bytes());
        }
        let mut z = Vec::with_capacity(4096);
        self.deflate
            .compress_vec(&block, &mut z, FlushCompress::Sync)
            .unwrap();
        let mut p = id.to_be_bytes().to_vec();
        p.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        p.extend_from_slice(&z);
        self.control(1, 0, &p).unwrap();
    }

    fn data(&mut self, id: u32, fin: bool, payload: &[u8]) -> std::io::Result<()> {
        let mut f = id.to_be_bytes().to_vec();
        f.push(u8::from(fin));
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
        f.extend_from_slice(payload);
        self.s.write_all(&f)
    }

    fn next(&mut self) -> Option<Frame> {
        loop {
            if self.buf.len() >= 8 {
                let len = u32::from_be_bytes([0, self.buf[5], self.buf[6], self.buf[7]]) as usize;
                if self.buf.len() >= 8 + len {
                    let f: Vec<u8> = self.buf.drain(..8 + len).collect();
                    let flags = f[4];
                    let payload = f[8..].to_vec();
                    return Some(if f[0] & 0x80 != 0 {
                        Frame::Control {
                            kind: u16::from_be_bytes([f[2], f[3]]),
                            payload,
                        }
                    } else {
                        Frame::Data {
                            stream: u32::from_be_bytes([f[0], f[1], f[2], f[3]]),
                            flags,
                            payload,
                        }
                    });
                }
            }
            let mut b = [0u8; 65536];
            match self.s.read(&mut b) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&b[..n]),
            }
        }
    }

    /// Decompresses a SYN_REPLY header block in the shared inflate context.
    fn reply_headers(&mut self, block: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; 4096];
        let before = self.inflate.total_out();
        match self
            .inflate
            .decompress(block, &mut out, FlushDecompress::Sync)
        {
            Err(e) if e.needs_dictionary().is_some() => {
                self.inflate.set_dictionary(&self.dict).unwrap();
                let used = self.inflate.total_in() as usize;
                self.inflate
                    .decompress(&block[used..], &mut out, FlushDecompress::Sync)
                    .unwrap();
            }
            r => {
                r.unwrap();
            }
        }
        out.truncate((self.inflate.total_out() - before) as usize);
        out
    }
}

/// Runs one SPDY exec: opens the streams, sends stdin, returns (stdout, stderr, status text).
/// The client behaves like spdystream: it echoes server PINGs and sends no WINDOW_UPDATE.
fn spdy_exec(h: &Harness, query: &str, stdin: &[u8]) -> (Vec<u8>, Vec<u8>, String, SpdyClient) {
    spdy_exec_with(h, query, stdin, false).0
}

/// What a flow-controlling client saw: WINDOW_UPDATE deltas the server granted for stdin
/// (stream 3) and for the session, and the most output it ever had outstanding beyond the
/// window it granted.
#[derive(Debug, Default)]
struct FlowSeen {
    stdin_granted: i64,
    session_granted: i64,
    max_over_window: i64,
}

/// Like `spdy_exec`; with `flow` the client does SPDY/3.1 flow control: it acknowledges what it
/// reads with stream and session WINDOW_UPDATEs, and checks the server stays within them.
fn spdy_exec_with(
    h: &Harness,
    query: &str,
    stdin: &[u8],
    flow: bool,
) -> ((Vec<u8>, Vec<u8>, String, SpdyClient), FlowSeen) {
    let (mut c, version) = SpdyClient::upgrade(
        h,
        &format!("/exec/ns1/web/agent?{query}"),
        "v4.channel.k8s.io, v3.channel.k8s.io",
    )
    .unwrap();
    assert_eq!(version, "v4.channel.k8s.io");
    c.syn_stream(1, "error");
    c.syn_stream(3, "stdin");
    c.syn_stream(5, "stdout");
    c.syn_stream(7, "stderr");
    let mut replies = 0;
    for chunk in stdin.chunks(30_000) {
        c.data(3, false, chunk).unwrap();
    }
    c.data(3, true, &[]).unwrap();
    let (mut out, mut err, mut status) = (Vec::new(), Vec::new(), Vec::new());
    let mut error_fin = false;
    let mut seen = FlowSeen::default();
    // Window the client granted for stdout (stream 5) and the session, and what arrived.
    let (mut granted5, mut granted0) = (65_536i64, 65_536i64);
    let (mut got5, mut got0, mut acked5, mut acked0) = (0i64, 0i64, 0i64, 0i64);
    while let Some(f) = c.next() {
        if let Frame::Data {
            stream, payload, ..
        } = &f
        {
            got0 += payload.len() as i64;
            if *stream == 5 {
                got5 += payload.len() as i64;
            }
            seen.max_over_window = seen
                .max_over_window
                .max(got0 - granted0)
                .max(got5 - granted5);
            // Consume and acknowledge in 20 KiB steps, as a reading client would.
            if flow && got5 - acked5 >= 20_000 {
                let d = (got5 - acked5) as u32;
                let mut p = 5u32.to_be_bytes().to_vec();
                p.extend_from_slice(&d.to_be_bytes());
                c.control(9, 0, &p).unwrap();
                granted5 += i64::from(d);
                acked5 = got5;
            }
            if flow && got0 - acked0 >= 20_000 {
                let d = (got0 - acked0) as u32;
                let mut p = 0u32.to_be_bytes().to_vec();
                p.extend_from_slice(&d.to_be_bytes());
                c.control(9, 0, &p).unwrap();
                granted0 += i64::from(d);
                acked0 = got0;
            }
        }
        match f {
            Frame::Control {
                kind: 6, payload, ..
            } => {
                // spdystream answers every PING of the other side.
                c.control(6, 0, &payload).unwrap();
            }
            Frame::Control {
                kind: 9, payload, ..
            } => {
                let id = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                let d = i64::from(u32::from_be_bytes([
                    payload[4], payload[5], payload[6], payload[7],
                ]));
                match id {
                    0 => seen.session_granted += d,
                    3 => seen.stdin_granted += d,
                    other => panic!("WINDOW_UPDATE for stream {other}"),
                }
            }
            Frame::Control {
                kind: 2, payload, ..
            } => {
                let block = c.reply_headers(&payload[4..]);
                assert_eq!(
                    &block[..4],
                    &[0, 0, 0, 0],
                    "SYN_REPLY carries an empty header block"
                );
                replies += 1;
            }
            Frame::Control { kind: 7, .. } => break,
            Frame::Control { .. } => {}
            Frame::Data {
                stream: 5, payload, ..
            } => out.extend_from_slice(&payload),
            Frame::Data {
                stream: 7, payload, ..
            } => err.extend_from_slice(&payload),
            Frame::Data {
                stream: 1,
                payload,
                flags,
            } => {
                status.extend_from_slice(&payload);
                error_fin |= flags & 1 != 0;
            }
            Frame::Data { .. } => {}
        }
    }
    assert_eq!(replies, 4);
    assert!(error_fin, "error stream half-closed");
    (
        (out, err, String::from_utf8_lossy(&status).into_owned(), c),
        seen,
    )
}

#[test]
fn spdy_flow_control_both_directions() {
    let h = harness();
    // Five times the initial window each way.
    let payload: Vec<u8> = (0..327_680u32).map(|i| (i * 13 % 251) as u8).collect();
    let ((out, _, status, _), seen) =
        spdy_exec_with(&h, "command=cat&input=1&output=1&error=1", &payload, true);
    assert!(out == payload, "{} of {} bytes", out.len(), payload.len());
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&status).unwrap()["status"],
        "Success"
    );
    // stdin beyond the first 64 KiB could only flow because the server re-opened the window.
    assert!(
        seen.stdin_granted >= payload.len() as i64 - 65_536,
        "stdin stream window updates: {seen:?}"
    );
    assert!(
        seen.session_granted >= payload.len() as i64 - 65_536,
        "session window updates: {seen:?}"
    );
    // Output never went beyond what this client granted.
    assert!(seen.max_over_window <= 0, "{seen:?}");

    // A spdystream-like peer (no WINDOW_UPDATE, answers PING) still gets all output: the
    // probe PING shows it does no flow control.
    let ((out, _, _, _), seen) =
        spdy_exec_with(&h, "command=cat&input=1&output=1&error=1", &payload, false);
    assert!(out == payload, "{} of {} bytes", out.len(), payload.len());
    assert!(seen.max_over_window > 0, "it was sent beyond 64 KiB");
}

#[test]
fn spdy_exec_stdin_stdout_exit_status_and_send_after_close() {
    let h = harness();
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let (out, err, status, mut c) = spdy_exec(&h, "command=cat&input=1&output=1&error=1", &payload);
    assert!(
        out == payload,
        "stdout is stdin ({} of {} bytes)",
        out.len(),
        payload.len()
    );
    assert!(err.is_empty());
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&status).unwrap()["status"],
        "Success"
    );
    // Sending after the session closed is harmless.
    let _ = c.data(3, false, b"late");
    let _ = c.control(6, 0, &9u32.to_be_bytes());
    drop(c);

    let (out, err, status, _) = spdy_exec(&h, "command=perl&command=-e&command=print+%22x%22%3B+print+STDERR+%22y%22%3B+exit+7&input=1&output=1&error=1", b"");
    assert_eq!((out.as_slice(), err.as_slice()), (&b"x"[..], &b"y"[..]));
    let st: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(st["reason"], "NonZeroExitCode");
    assert_eq!(st["details"]["causes"][0]["message"], "7");

    // Streams opened in another order and a PING before them still work.
    let (mut c, _) = SpdyClient::upgrade(
        &h,
        "/exec/ns1/web/agent?command=echo&command=hi&output=1",
        "v4.channel.k8s.io",
    )
    .unwrap();
    c.control(6, 0, &1u32.to_be_bytes()).unwrap();
    c.syn_stream(1, "stdout");
    c.syn_stream(3, "error");
    let mut got = Vec::new();
    let mut pinged = false;
    while let Some(f) = c.next() {
        match f {
            Frame::Control {
                kind: 2, payload, ..
            } => {
                c.reply_headers(&payload[4..]);
            }
            Frame::Control {
                kind: 6, payload, ..
            } => pinged = payload == 1u32.to_be_bytes(),
            Frame::Control { kind: 7, .. } => break,
            Frame::Data {
                stream: 1, payload, ..
            } => got.extend_from_slice(&payload),
            _ => {}
        }
    }
    assert!(pinged);
    assert_eq!(got, b"hi\n");
    drop(c);
    let c = h.wait_idle();
    assert_eq!(
        (c.connections, c.children, c.reactor_children),
        (0, 0, 0),
        "{c:?}"
    );
}

#[test]
fn spdy_errors_pod_without_vm_and_garbage_frames() {
    let h = harness();
    let e = SpdyClient::upgrade(
        &h,
        "/exec/ns1/cold/agent?command=true&output=1",
        "v4.channel.k8s.io",
    )
    .err()
    .unwrap();
    assert!(
        e.starts_with("HTTP/1.1 500") && e.contains("Content-Length"),
        "{e}"
    );
    // The pod's own container name reaches the VM as `agent` does (the Go daemon ignores it).
    let own_name = SpdyClient::upgrade(
        &h,
        "/exec/ns1/web/sidecar?command=true&output=1",
        "v4.channel.k8s.io",
    );
    assert!(own_name.is_ok(), "{:?}", own_name.err());
    drop(own_name);
    let e = SpdyClient::upgrade(&h, "/exec/ns1/web/agent?command=true", "v4.channel.k8s.io")
        .err()
        .unwrap();
    assert!(e.starts_with("HTTP/1.1 400"), "no stream requested: {e}");
    // Garbage after the upgrade: GOAWAY and close, no child started.
    let (mut c, _) = SpdyClient::upgrade(
        &h,
        "/exec/ns1/web/agent?command=sleep&command=600&output=1",
        "v4.channel.k8s.io",
    )
    .unwrap();
    c.s.write_all(&[0x80, 0x07, 0x00, 0x01, 0x00, 0x00, 0x00, 0x02, 0xde, 0xad])
        .unwrap();
    let mut saw_goaway = false;
    while let Some(f) = c.next() {
        if let Frame::Control { kind: 7, .. } = f {
            saw_goaway = true;
        }
    }
    assert!(saw_goaway);
    // A client that upgrades and never opens its streams is dropped after the setup timeout;
    // here it simply leaves.
    let (c2, _) = SpdyClient::upgrade(
        &h,
        "/exec/ns1/web/agent?command=sleep&command=600&output=1",
        "v4.channel.k8s.io",
    )
    .unwrap();
    drop(c2);
    let ok = h
        .request(
            h.client_config(None, &h.pki.ca_pem),
            "GET",
            "/healthz",
            &[("Authorization", "Bearer admin-token")],
        )
        .unwrap();
    assert_eq!(ok.status, 200, "the loop keeps serving");
    let c = h.wait_idle();
    assert_eq!(
        (c.connections, c.children, c.reactor_children),
        (0, 0, 0),
        "{c:?}"
    );
}

#[test]
fn attach_streams_the_vm_console() {
    let h = harness();
    std::fs::write(h.log_dir.join("vm-web.log"), "boot ok\n").unwrap();
    let mut ws = {
        let s = h.connect(h.client_config(None, &h.pki.ca_pem)).unwrap();
        let mut req = "wss://localhost/attach/ns1/web/agent?output=1"
            .into_client_request()
            .unwrap();
        req.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            "v4.channel.k8s.io".parse().unwrap(),
        );
        req.headers_mut()
            .insert("Authorization", "Bearer admin-token".parse().unwrap());
        tungstenite::client::client(req, s).unwrap().0
    };
    let mut got = Vec::new();
    while !got.ends_with(b"boot ok\n") {
        if let Message::Binary(b) = ws.read().unwrap() {
            if b.first() == Some(&1) {
                got.extend_from_slice(&b[1..]);
            }
        }
    }
    drop(ws);
    let c = h.wait_idle();
    assert_eq!(
        (c.connections, c.children, c.reactor_children),
        (0, 0, 0),
        "{c:?}"
    );
}

/// Benchmark: stdin→stdout echo through the kubelet exec path vs the same command run directly.
/// `cargo test --release --test contract -- --ignored --nocapture kubelet_exec::bench_exec_throughput`
#[test]
#[ignore]
fn bench_exec_throughput() {
    let h = harness();
    const TOTAL: usize = 64 << 20;
    let chunk = vec![0x5au8; 64 * 1024];
    // Direct: the stand-in cocoon running cat, fed and drained by two threads.
    let mut argv = kubelet_support::stand_in_cocoon(&h.log_dir);
    argv.extend(["vm", "exec", "-i", "vm-web", "--", "cat"].map(String::from));
    let t0 = Instant::now();
    let mut child = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let c2 = chunk.clone();
    let feeder = std::thread::spawn(move || {
        for _ in 0..TOTAL / c2.len() {
            stdin.write_all(&c2).unwrap();
        }
    });
    let mut stdout = child.stdout.take().unwrap();
    let mut n = 0;
    let mut b = vec![0u8; 256 * 1024];
    while n < TOTAL {
        let k = stdout.read(&mut b).unwrap();
        assert!(k > 0);
        n += k;
    }
    feeder.join().unwrap();
    child.wait().unwrap();
    let direct = TOTAL as f64 / (1 << 20) as f64 / t0.elapsed().as_secs_f64();

    // Through the kubelet: WebSocket v5 exec of the same command.
    let ws = ws_connect(&h, "command=cat&input=1&output=1", "v5.channel.k8s.io");
    let t1 = Instant::now();
    let ws = std::sync::Arc::new(std::sync::Mutex::new(ws));
    // tungstenite is not split into halves; interleave writes and reads on one thread.
    let mut ws = std::sync::Arc::try_unwrap(ws)
        .ok()
        .unwrap()
        .into_inner()
        .unwrap();
    let mut sent = 0;
    let mut recv = 0;
    let mut msg = vec![0u8];
    msg.extend_from_slice(&chunk);
    while recv < TOTAL {
        if sent < TOTAL && sent - recv < 4 << 20 {
            ws.send(Message::Binary(msg.clone().into())).unwrap();
            sent += chunk.len();
            continue;
        }
        if let Message::Binary(b) = ws.read().unwrap() {
            if b.first() == Some(&1) {
                recv += b.len() - 1;
            }
        }
    }
    let kubelet = TOTAL as f64 / (1 << 20) as f64 / t1.elapsed().as_secs_f64();
    println!("exec echo throughput: direct {direct:.0} MiB/s, through kubelet WebSocket/TLS {kubelet:.0} MiB/s ({TOTAL} bytes)");
}
