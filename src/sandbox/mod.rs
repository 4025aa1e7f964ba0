//! The embedded sandbox: a fake Kubernetes API server and a fake cocoon for tests and demos.
//! Test infrastructure that follows the specs; the daemon itself never depends on it.

pub mod apiserver;
pub mod fake_cocoon;

/// Entry point of `vk-cocoon sandbox ...` (filled in by the lead): `args` are the
/// arguments after `sandbox`. Returns the process exit code.
pub fn run_sandbox(args: Vec<String>) -> i32 {
    let _ = args;
    eprintln!("vk-cocoon sandbox: not implemented yet");
    1
}
