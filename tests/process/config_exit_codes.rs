//! Hostile configuration reaches the real binary as a configuration error (exit 2, one clear
//! line), never as a runtime failure or an abort: out-of-range quantities, a bad client or
//! registry CA file, a kubeconfig YAML alias bomb.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_vk-cocoon");

/// The daemon with a minimal environment plus `extra`; returns (exit code, stderr).
fn run(dir: &std::path::Path, extra: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", dir)
        .env("OCI_REGISTRY", "127.0.0.1:1/vk-cocoon-test")
        .env("VK_LOG_LEVEL", "off")
        .env("VK_NODE_NAME", "vk-config-test")
        .env("VK_NODE_IP", "127.0.0.1")
        .env("VK_METRICS_ADDR", "127.0.0.1:0")
        .env("VK_PEER_ADDR", "127.0.0.1:0")
        .env("VK_STATE_DIR", dir.join("vk-state"))
        .env("VK_KUBELET_PORT", "0");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("the binary runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn out_of_range_quantities_and_bad_ca_files_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("ca.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let garbage = garbage.to_string_lossy().into_owned();
    for (var, value) in [
        ("VK_NODE_MEM", "1e400"),
        ("VK_NODE_PODS", "-5"),
        ("VK_CLIENT_CA_FILE", garbage.as_str()),
        ("VK_CLIENT_CA_FILE", "/nonexistent/ca.pem"),
        ("OCI_REGISTRY_CA_FILE", garbage.as_str()),
        ("OCI_REGISTRY_CA_FILE", "/nonexistent/ca.pem"),
    ] {
        let (code, stderr) = run(dir.path(), &[(var, value)]);
        assert_eq!(code, Some(2), "{var}={value}: {stderr}");
        assert!(
            stderr.starts_with(&format!("vk-cocoon: configuration error: {var}=")),
            "{var}={value}: {stderr}"
        );
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    }
}

#[test]
fn a_kubeconfig_alias_bomb_is_a_clear_error_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    // Nine levels of ten aliases: a billion nodes if a loader expanded them.
    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    let names = ["a", "b", "c", "d", "e", "f", "g", "h", "i"];
    for w in names.windows(2) {
        let refs = vec![format!("*{}", w[0]); 10].join(", ");
        bomb.push_str(&format!("{}: &{} [{refs}]\n", w[1], w[1]));
    }
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, bomb).unwrap();
    let (code, stderr) = run(
        dir.path(),
        // The start-up error goes to the log.
        &[
            ("KUBECONFIG", path.to_string_lossy().as_ref()),
            ("VK_LOG_LEVEL", "error"),
        ],
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("alias bomb"), "{stderr}");
}
