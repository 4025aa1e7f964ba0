//! The lease file reader against real files: edits by atomic rename are picked up, broken
//! versions give typed errors that are logged once per version, and the file recovers.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use vk_cocoon::network::leases::{LeaseError, LeaseFile};

/// Write like cocoon-net does: to a temporary name, then rename over the target.
fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn row(mac: &str, ip: &str, expiry: &str) -> String {
    format!(r#"{{"mac":"{mac}","ip":"{ip}","expiry":"{expiry}"}}"#)
}

const MAC: &str = "02:00:0a:00:00:05";
const FAR: &str = "2099-01-01T00:00:00Z";

#[test]
fn edits_are_picked_up_and_errors_logged_once_per_version() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leases.json");
    let mut leases = LeaseFile::new(&path);
    let now = SystemTime::now();

    let err = leases.lookup(MAC, now).unwrap_err();
    assert!(matches!(err, LeaseError::Missing { .. }), "{err}");
    assert!(leases.should_log(&err));
    let again = leases.lookup(MAC, now).unwrap_err();
    assert!(!leases.should_log(&again));

    write_atomic(&path, "null");
    assert_eq!(leases.lookup(MAC, now), Ok(None));

    write_atomic(&path, &format!("[{}]", row(MAC, "10.88.0.5", FAR)));
    let lease = leases.lookup("02:00:0A:00:00:05", now).unwrap().unwrap();
    assert_eq!(lease.ip, Ipv4Addr::new(10, 88, 0, 5));

    // cocoon-net rebinds the MAC: same size, new content, new inode.
    write_atomic(&path, &format!("[{}]", row(MAC, "10.88.0.6", FAR)));
    assert_eq!(
        leases.lookup(MAC, now).unwrap().unwrap().ip,
        Ipv4Addr::new(10, 88, 0, 6)
    );

    // A truncated write: typed error, logged once, not re-logged while the file is unchanged.
    write_atomic(&path, &format!("[{}", row(MAC, "10.88.0.6", FAR)));
    let err = leases.lookup(MAC, now).unwrap_err();
    assert!(matches!(err, LeaseError::Truncated { .. }), "{err}");
    assert!(leases.should_log(&err));
    let again = leases.lookup(MAC, now).unwrap_err();
    assert_eq!(again, err);
    assert!(!leases.should_log(&again));

    // A different broken version is logged again.
    write_atomic(&path, "this is not json");
    let err = leases.lookup(MAC, now).unwrap_err();
    assert!(matches!(err, LeaseError::NotJson { .. }), "{err}");
    assert!(leases.should_log(&err));

    write_atomic(&path, "");
    assert!(matches!(
        leases.lookup(MAC, now),
        Err(LeaseError::Empty { .. })
    ));

    // The same MAC twice: that MAC is an error, others still resolve.
    let other = "02:00:0a:00:00:07";
    write_atomic(
        &path,
        &format!(
            "[{},{},{}]",
            row(MAC, "10.88.0.5", FAR),
            row(other, "10.88.0.7", FAR),
            row(MAC, "10.88.0.9", FAR)
        ),
    );
    assert!(matches!(
        leases.lookup(MAC, now),
        Err(LeaseError::DuplicateMac { .. })
    ));
    assert_eq!(
        leases.lookup(other, now).unwrap().unwrap().ip,
        Ipv4Addr::new(10, 88, 0, 7)
    );

    // Recovery.
    write_atomic(&path, &format!("[{}]", row(MAC, "10.88.0.5", FAR)));
    assert!(leases.lookup(MAC, now).unwrap().is_some());
}

#[test]
fn expiry_is_compared_with_now() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leases.json");
    write_atomic(
        &path,
        &format!("[{}]", row(MAC, "10.88.0.5", "2026-08-01T12:00:00+08:00")),
    );
    let mut leases = LeaseFile::new(&path);
    let expiry = UNIX_EPOCH + Duration::from_secs(1_785_556_800);
    assert!(leases
        .lookup(MAC, expiry - Duration::from_secs(1))
        .unwrap()
        .is_some());
    assert_eq!(leases.lookup(MAC, expiry), Ok(None));
    assert_eq!(
        leases.lookup("02:00:0a:00:00:99", expiry - Duration::from_secs(1)),
        Ok(None)
    );
}

#[test]
fn in_place_edit_with_new_size_is_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leases.json");
    std::fs::write(&path, "null").unwrap();
    let mut leases = LeaseFile::new(&path);
    let now = SystemTime::now();
    assert_eq!(leases.lookup(MAC, now), Ok(None));
    std::fs::write(&path, format!("[{}]", row(MAC, "10.88.0.5", FAR))).unwrap();
    assert!(leases.lookup(MAC, now).unwrap().is_some());
}
