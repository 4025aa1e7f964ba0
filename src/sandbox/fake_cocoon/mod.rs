//! A fake `cocoon` CLI that keeps VMs, snapshots and images as files under a state directory.
//! Run when the binary is invoked as `cocoon` (argv[0]) or as `vk-cocoon fake-cocoon ...`.

/// Entry point of the fake: `args` are the arguments after the program name. Returns the exit code.
pub fn main(args: Vec<String>) -> i32 {
    let _ = args;
    eprintln!("Error: fake cocoon not implemented yet");
    1
}
