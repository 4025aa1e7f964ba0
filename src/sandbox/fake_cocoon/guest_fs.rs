//! The fake guest's files: `vm exec` writes them with `echo … > /path` and reads them with `cat
//! /path`; they live on the VM's disk, so a snapshot carries them and a clone of it has them.
//!
//! Each guest file is one flat `guest-<hex of its path>` file in the VM's run dir and in a
//! snapshot's data dir (flat, so snapshot export / import carry them as ordinary members).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

const PREFIX: &str = "guest-";
/// Longest guest path kept (its hex form stays well inside a file name).
const PATH_MAX: usize = 100;

/// Where the guest file `path` of a disk in `dir` lives; None for a path the fake does not keep.
fn file_for(dir: &Path, path: &str) -> Option<PathBuf> {
    if !path.starts_with('/') || path.len() > PATH_MAX || path.contains('\0') {
        return None;
    }
    let hex: String = path.bytes().map(|b| format!("{b:02x}")).collect();
    Some(dir.join(format!("{PREFIX}{hex}")))
}

/// Runs a guest command that touches files, if `argv` is one: `cat /path`, or `sh -c` with
/// `echo words > /path` or `cat /path`. None: not a file command (the caller interprets it).
pub fn exec(run_dir: &Path, argv: &[String]) -> Option<i32> {
    let words: Vec<String> = match argv {
        [sh, c, script]
            if matches!(sh.rsplit('/').next(), Some("sh" | "bash" | "ash" | "dash"))
                && c == "-c" =>
        {
            script
                .split_whitespace()
                .map(|w| w.trim_matches(['\'', '"']).to_string())
                .collect()
        }
        other => other.to_vec(),
    };
    match words.as_slice() {
        [cat, path] if cat == "cat" && path.starts_with('/') => Some(read(run_dir, path)),
        [echo, rest @ ..] if echo == "echo" && rest.len() >= 2 && rest[rest.len() - 2] == ">" => {
            let text = rest[..rest.len() - 2].join(" ");
            Some(write(run_dir, &rest[rest.len() - 1], &text))
        }
        _ => None,
    }
}

fn read(run_dir: &Path, path: &str) -> i32 {
    match file_for(run_dir, path).map(fs::read) {
        Some(Ok(bytes)) => {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(&bytes);
            let _ = out.flush();
            0
        }
        _ => {
            eprintln!("cat: {path}: No such file or directory");
            1
        }
    }
}

fn write(run_dir: &Path, path: &str, text: &str) -> i32 {
    let Some(file) = file_for(run_dir, path) else {
        eprintln!("sh: cannot create {path}: unsupported path");
        return 2;
    };
    match fs::write(file, format!("{text}\n")) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("sh: cannot create {path}: {e}");
            2
        }
    }
}

/// Copies the guest's disk contents in `from` to `to` (snapshot save, clone): its files, and a
/// `guest.data` blob a test may have written into a run dir to stand for them.
pub fn copy(from: &Path, to: &Path) -> Result<(), String> {
    let Ok(entries) = fs::read_dir(from) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let n = name.to_string_lossy();
        if n.starts_with(PREFIX) || n == "guest.data" {
            fs::copy(e.path(), to.join(&name))
                .map_err(|err| format!("copy guest file {}: {err}", name.to_string_lossy()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn files_written_by_exec_are_read_back_and_copied_with_the_disk() {
        let dir = std::env::temp_dir().join(format!("guest-fs-{}", std::process::id()));
        let (vm, snap) = (dir.join("vm"), dir.join("snap"));
        fs::create_dir_all(&vm).unwrap();
        fs::create_dir_all(&snap).unwrap();
        let w = argv(&["sh", "-c", "echo 'hello fork' > /root/mark"]);
        assert_eq!(exec(&vm, &w), Some(0));
        assert_eq!(
            fs::read_to_string(file_for(&vm, "/root/mark").unwrap()).unwrap(),
            "hello fork\n"
        );
        assert_eq!(exec(&vm, &argv(&["cat", "/root/missing"])), Some(1));
        assert_eq!(exec(&vm, &argv(&["hostname"])), None);
        assert_eq!(exec(&vm, &argv(&["sh", "-c", "echo > ../x"])), Some(2));
        fs::write(vm.join("guest.data"), b"blob").unwrap();
        fs::write(vm.join("cow.raw"), b"disk").unwrap();
        copy(&vm, &snap).unwrap();
        assert!(file_for(&snap, "/root/mark").unwrap().exists());
        assert_eq!(fs::read(snap.join("guest.data")).unwrap(), b"blob");
        assert!(!snap.join("cow.raw").exists());
        let _ = fs::remove_dir_all(&dir);
    }
}
