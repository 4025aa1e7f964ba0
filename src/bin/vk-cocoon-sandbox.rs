//! vk-cocoon-sandbox: the sandbox (fake API server, fake cocoon, the real daemon code) and the
//! fake `cocoon` and `cocoon-macos` CLIs, kept out of the `vk-cocoon` binary that systemd runs.

use std::path::Path;

use vk_cocoon::{sandbox, version};

fn main() {
    std::process::exit(real_main());
}

fn real_main() -> i32 {
    // Arguments that are not UTF-8 are passed on lossily rather than panicking.
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let argv0 = args
        .first()
        .map(String::as_str)
        .unwrap_or("vk-cocoon-sandbox");
    let rest = args.get(1..).unwrap_or_default().to_vec();
    if Path::new(argv0).file_name().is_some_and(|n| n == "cocoon") {
        return sandbox::fake_cocoon::main_as_cocoon(Path::new(argv0), rest);
    }
    if Path::new(argv0)
        .file_name()
        .is_some_and(|n| n == "cocoon-macos")
    {
        return sandbox::fake_cocoon_macos::main_as_cocoon_macos(Path::new(argv0), rest);
    }
    match rest.first().map(String::as_str) {
        Some("-V" | "--version" | "version") => {
            println!("{}", version::long_version());
            0
        }
        Some("fake-cocoon") => sandbox::fake_cocoon::main(rest[1..].to_vec()),
        Some("fake-cocoon-macos") => sandbox::fake_cocoon_macos::main(rest[1..].to_vec()),
        _ => sandbox::run_sandbox(rest),
    }
}
