//! exec through the kubelet API against the project's fake cocoon (`vk-cocoon-sandbox fake-cocoon`), whose
//! `vm exec` interprets the guest command: stdin reaches `cat`, `exit N` becomes the exit status.

use crate::kubelet_support;

use std::path::PathBuf;
use std::process::Command;

use kubelet_support::{pod, Harness, Options};
use tungstenite::client::IntoClientRequest;
use tungstenite::Message;

fn fake(state: &std::path::Path, args: &[String]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vk-cocoon-sandbox"))
        .arg("fake-cocoon")
        .args(args)
        .env("FAKE_COCOON_STATE", state)
        .output()
        .unwrap()
}

#[test]
fn websocket_exec_through_the_fake_cocoon() {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_vk-cocoon-sandbox"));
    let probe = Command::new(&bin)
        .args(["fake-cocoon", "version"])
        .output()
        .unwrap();
    if !String::from_utf8_lossy(&probe.stdout).contains("cocoon fake") {
        eprintln!("SKIP: vk-cocoon-sandbox does not dispatch `fake-cocoon`");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let image = "ghcr.io/example/ubuntu:24.04";
    assert!(fake(&state, &vk_cocoon::vm::argv::image_pull(image, false))
        .status
        .success());
    let run = fake(
        &state,
        &vk_cocoon::vm::argv::vm_run(&vk_cocoon::vm::RunOptions {
            image: image.into(),
            name: "vk-ns1-web".into(),
            cpu: 1,
            memory: "1073741824".into(),
            ..Default::default()
        }),
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let vm: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let id = vm["id"].as_str().unwrap().to_string();

    // The harness's tweak is a plain fn; the fake's state directory travels in the environment.
    std::env::set_var("KUBELET_TEST_FAKE_STATE", &state);
    let h = Harness::start(Options {
        pods: vec![pod("ns1", "web", Some((&id, 0)))],
        tweak: |c| {
            c.cocoon = vec![
                env!("CARGO_BIN_EXE_vk-cocoon-sandbox").to_string(),
                "fake-cocoon".to_string(),
            ];
            c.cocoon_env = vec![(
                "FAKE_COCOON_STATE".into(),
                std::env::var("KUBELET_TEST_FAKE_STATE").unwrap(),
            )];
        },
        ..Default::default()
    });
    let connect = |query: &str| {
        let s = h.connect(h.client_config(None, &h.pki.ca_pem)).unwrap();
        let mut req = format!("wss://localhost/exec/ns1/web/agent?{query}")
            .into_client_request()
            .unwrap();
        req.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            "v5.channel.k8s.io".parse().unwrap(),
        );
        req.headers_mut()
            .insert("Authorization", "Bearer admin-token".parse().unwrap());
        tungstenite::client::client(req, s).unwrap().0
    };
    let collect = |ws: &mut tungstenite::WebSocket<_>| -> (Vec<u8>, serde_json::Value) {
        let mut out = Vec::new();
        loop {
            match ws.read().unwrap() {
                Message::Binary(b) if b.first() == Some(&1) => out.extend_from_slice(&b[1..]),
                Message::Binary(b) if b.first() == Some(&3) => {
                    return (out, serde_json::from_slice(&b[1..]).unwrap())
                }
                Message::Close(_) => panic!("closed without a status"),
                _ => {}
            }
        }
    };
    let mut ws = connect("command=cat&input=1&output=1&error=1");
    ws.send(Message::Binary(
        [&[0u8][..], b"through the fake guest\n"].concat().into(),
    ))
    .unwrap();
    ws.send(Message::Binary(vec![255u8, 0].into())).unwrap();
    let (out, status) = collect(&mut ws);
    assert_eq!(out, b"through the fake guest\n");
    assert_eq!(status["status"], "Success");
    drop(ws);
    let mut ws = connect("command=exit&command=5&output=1");
    let (_, status) = collect(&mut ws);
    assert_eq!(status["details"]["causes"][0]["message"], "5");
    drop(ws);
    // The fake recorded both calls with the argv the kubelet built.
    let log = std::fs::read_to_string(state.join("exec.log")).unwrap();
    assert!(
        log.contains("[\"cat\"]") && log.contains("\"stdin\":true"),
        "{log}"
    );
    assert!(log.contains("[\"exit\",\"5\"]"), "{log}");
    let c = h.wait_idle();
    assert_eq!(
        (c.connections, c.children, c.reactor_children),
        (0, 0, 0),
        "{c:?}"
    );
}
