//! The host's side of the source rules (`provider::sources`): resolving an http(s) image URL's
//! host and walking a clone-from-dir, on a worker thread: a DNS lookup or a stat on a slow
//! filesystem blocks, and the event loop must not.
//!
//! cocoon resolves the name again when it fetches: an answer that changes in between (DNS
//! rebinding) is out of reach without pinning the address, which cocoon's CLI cannot take. A
//! symlink is refused rather than resolved, so the directory checked is the one cocoon opens
//! (as long as only the operator can write below the root).

use std::net::{IpAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use crate::provider::sources;
use crate::provider::{SourceCheck, SourceVerdict};

/// The verdict on one check (blocking: run it on a worker).
pub(super) fn run(check: &SourceCheck) -> SourceVerdict {
    match check {
        SourceCheck::ImageHost { url, host } => image_host(url, host),
        SourceCheck::CloneDir { dir, root } => clone_dir(dir, root),
    }
}

/// Every component of `dir` below `root` is looked at with lstat: none may be a symlink, and
/// the last must be a directory. A missing one is retried (the export may still be coming).
fn clone_dir(dir: &str, root: &str) -> SourceVerdict {
    let setting = sources::CLONE_DIR_ROOT_SETTING;
    let Ok(below) = Path::new(dir).strip_prefix(root) else {
        return SourceVerdict::Refused(format!(
            "clone-from-dir {dir} refused: not below {setting} ({root})"
        ));
    };
    let mut path = PathBuf::from(root);
    let mut last_is_dir = false;
    for part in below.components() {
        path.push(part);
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_symlink() => {
                return SourceVerdict::Refused(format!(
                    "clone-from-dir {dir} refused: {} is a symlink (none may be below {setting})",
                    path.display()
                ))
            }
            Ok(m) => last_is_dir = m.is_dir(),
            Err(e) => {
                return SourceVerdict::Unavailable(format!(
                    "clone-from-dir {dir}: {}: {e}",
                    path.display()
                ))
            }
        }
    }
    if last_is_dir {
        SourceVerdict::Allowed
    } else {
        SourceVerdict::Refused(format!("clone-from-dir {dir} refused: not a directory"))
    }
}

fn image_host(url: &str, host: &str) -> SourceVerdict {
    let addrs: Vec<IpAddr> = match (host, 0u16).to_socket_addrs() {
        Ok(addrs) => addrs.map(|a| a.ip()).collect(),
        Err(e) => {
            return SourceVerdict::Unavailable(format!("image URL {url:?}: resolve {host}: {e}"))
        }
    };
    match sources::check_resolved(url, host, &addrs) {
        Ok(()) => SourceVerdict::Allowed,
        Err(e @ sources::ResolvedError::NoAddress { .. }) => {
            SourceVerdict::Unavailable(e.to_string())
        }
        Err(e) => SourceVerdict::Refused(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clone_dir_with_a_symlink_below_the_root_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let r = root.path().to_str().unwrap().to_string();
        std::fs::create_dir_all(root.path().join("team/vm-a")).unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("evil")).unwrap();
        std::fs::write(root.path().join("file"), b"x").unwrap();
        let check = |d: &str| {
            run(&SourceCheck::CloneDir {
                dir: format!("{r}/{d}"),
                root: r.clone(),
            })
        };
        assert_eq!(check("team/vm-a"), SourceVerdict::Allowed);
        match check("evil") {
            SourceVerdict::Refused(m) => assert!(m.contains("evil is a symlink"), "{m}"),
            other => panic!("{other:?}"),
        }
        std::fs::create_dir(outside.path().join("vm-b")).unwrap();
        assert!(matches!(check("evil/vm-b"), SourceVerdict::Refused(_)));
        assert!(matches!(check("file"), SourceVerdict::Refused(_)));
        assert!(matches!(
            check("team/missing"),
            SourceVerdict::Unavailable(_)
        ));
    }

    #[test]
    fn a_name_for_loopback_is_refused_after_resolution() {
        // `localhost` itself is refused by name in the core; a numeric name such as
        // `2130706433` only resolves (libc reads it as 127.0.0.1).
        let check = SourceCheck::ImageHost {
            url: "http://2130706433/img".into(),
            host: "2130706433".into(),
        };
        match run(&check) {
            SourceVerdict::Refused(m) => assert!(m.contains("a loopback address"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
