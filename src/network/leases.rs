//! The cocoon-net lease file: stat on every lookup, re-parse only when it changed.
//! Parsing and lookups only; it never writes the file and never talks to cocoon-net.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::Ipv4Addr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Where cocoon-net writes its leases when `VK_LEASES_PATH` is unset or empty.
pub const DEFAULT_LEASES_PATH: &str = "/var/lib/cocoon/net/leases.json";

/// Files larger than this are refused: a lease table for a dense host is a few hundred KiB.
const MAX_FILE_BYTES: u64 = 64 * 1024 * 1024;

/// One live DHCP lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Lower-case colon form, as cocoon-net writes it.
    pub mac: String,
    pub ip: Ipv4Addr,
    pub expiry: SystemTime,
}

/// Why the lease file could not answer. Distinct from "no lease" (`Ok(None)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseError {
    /// The file does not exist (cocoon-net not running yet, or wrong path).
    Missing { path: PathBuf },
    /// stat or read failed for another reason.
    Io { path: PathBuf, message: String },
    /// Zero bytes or only whitespace (`null` is the valid empty table).
    Empty { path: PathBuf },
    /// The JSON ends early: a writer that did not rename atomically, or a full disk.
    Truncated { path: PathBuf, message: String },
    /// Not JSON at all.
    NotJson { path: PathBuf, message: String },
    /// JSON, but not an array (or null) of objects.
    Schema { path: PathBuf, message: String },
    /// The queried MAC is listed more than once. The file is ambiguous for this MAC only:
    /// neither row wins, lookups of other MACs still succeed.
    DuplicateMac { path: PathBuf, mac: String },
    /// Larger than we are willing to read on the event loop.
    TooLarge { path: PathBuf, bytes: u64 },
}

impl fmt::Display for LeaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseError::Missing { path } => write!(f, "lease file {}: not found", path.display()),
            LeaseError::Io { path, message } => {
                write!(f, "lease file {}: {message}", path.display())
            }
            LeaseError::Empty { path } => write!(f, "lease file {}: empty", path.display()),
            LeaseError::Truncated { path, message } => {
                write!(
                    f,
                    "lease file {}: truncated JSON: {message}",
                    path.display()
                )
            }
            LeaseError::NotJson { path, message } => {
                write!(f, "lease file {}: not JSON: {message}", path.display())
            }
            LeaseError::Schema { path, message } => {
                write!(
                    f,
                    "lease file {}: unexpected shape: {message}",
                    path.display()
                )
            }
            LeaseError::DuplicateMac { path, mac } => {
                write!(
                    f,
                    "lease file {}: MAC {mac} listed more than once",
                    path.display()
                )
            }
            LeaseError::TooLarge { path, bytes } => {
                write!(
                    f,
                    "lease file {}: {bytes} bytes is too large",
                    path.display()
                )
            }
        }
    }
}

impl std::error::Error for LeaseError {}

/// What identifies one written version of the file. cocoon-net replaces the file by rename, so
/// the inode changes on every write; mtime and size are what the spec names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileVersion {
    pub mtime_ns: i128,
    pub size: u64,
    pub inode: u64,
}

#[derive(Debug)]
enum Row {
    One(Lease),
    Duplicate,
}

/// A parsed snapshot of the file, or the error parsing produced (cached until the file changes).
type Table = Result<HashMap<String, Row>, LeaseError>;

/// Reader of the cocoon-net lease file. Cheap to query: one `stat` per lookup.
#[derive(Debug)]
pub struct LeaseFile {
    path: PathBuf,
    cached: Option<(FileVersion, Table)>,
    /// Rows skipped (bad MAC, IP or expiry) in the cached version, for diagnostics.
    skipped_rows: usize,
    /// The last error reported through `should_log`, with the file version it came from.
    logged: Option<(Option<FileVersion>, String)>,
}

impl LeaseFile {
    pub fn new(path: impl Into<PathBuf>) -> LeaseFile {
        LeaseFile {
            path: path.into(),
            cached: None,
            skipped_rows: 0,
            logged: None,
        }
    }

    /// `VK_LEASES_PATH`, empty or unset meaning the default path.
    pub fn from_env() -> LeaseFile {
        match std::env::var_os("VK_LEASES_PATH") {
            Some(p) if !p.is_empty() => LeaseFile::new(p),
            _ => LeaseFile::new(DEFAULT_LEASES_PATH),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Rows ignored in the current version because their MAC, IP or expiry did not parse.
    pub fn skipped_rows(&self) -> usize {
        self.skipped_rows
    }

    /// The version last parsed, if any.
    pub fn version(&self) -> Option<FileVersion> {
        self.cached.as_ref().map(|(v, _)| *v)
    }

    /// The lease for `mac` if one exists and `now < expiry`; `Ok(None)` is "no lease".
    /// Stats the file every time and re-parses only when it changed.
    pub fn lookup(&mut self, mac: &str, now: SystemTime) -> Result<Option<Lease>, LeaseError> {
        self.refresh()?;
        let key = normalize_mac(mac).unwrap_or_else(|| mac.trim().to_ascii_lowercase());
        let table = match &self.cached {
            Some((_, table)) => table,
            None => return Ok(None),
        };
        let rows = table.as_ref().map_err(Clone::clone)?;
        match rows.get(&key) {
            None => Ok(None),
            Some(Row::Duplicate) => Err(LeaseError::DuplicateMac {
                path: self.path.clone(),
                mac: key,
            }),
            Some(Row::One(lease)) if now < lease.expiry => Ok(Some(lease.clone())),
            Some(Row::One(_)) => Ok(None),
        }
    }

    /// True the first time a given error is seen for the current file version; false for
    /// repeats, so a broken file is logged once per change rather than once per probe.
    pub fn should_log(&mut self, err: &LeaseError) -> bool {
        let key = (self.version(), err.to_string());
        if self.logged.as_ref() == Some(&key) {
            return false;
        }
        self.logged = Some(key);
        true
    }

    fn refresh(&mut self) -> Result<(), LeaseError> {
        let meta = match std::fs::metadata(&self.path) {
            Ok(m) => m,
            Err(e) => {
                self.cached = None;
                return Err(self.io_error(e));
            }
        };
        let version = FileVersion {
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            size: meta.len(),
            inode: meta.ino(),
        };
        if self.version() == Some(version) {
            return Ok(());
        }
        if meta.len() > MAX_FILE_BYTES {
            let err = LeaseError::TooLarge {
                path: self.path.clone(),
                bytes: meta.len(),
            };
            self.cached = Some((version, Err(err)));
            self.skipped_rows = 0;
            return Ok(());
        }
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) => {
                self.cached = None;
                return Err(self.io_error(e));
            }
        };
        let (table, skipped) = parse_table(&self.path, &bytes);
        self.skipped_rows = skipped;
        self.cached = Some((version, table));
        Ok(())
    }

    fn io_error(&self, e: io::Error) -> LeaseError {
        if e.kind() == io::ErrorKind::NotFound {
            LeaseError::Missing {
                path: self.path.clone(),
            }
        } else {
            LeaseError::Io {
                path: self.path.clone(),
                message: e.to_string(),
            }
        }
    }
}

/// Parse the whole file. Returns the table (or the file-level error) and the number of rows
/// skipped because a field did not parse.
fn parse_table(path: &Path, bytes: &[u8]) -> (Table, usize) {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return (
            Err(LeaseError::Empty {
                path: path.to_path_buf(),
            }),
            0,
        );
    }
    let value: serde_json::Value = match serde_json::from_slice(bytes) {
        Ok(v) => v,
        Err(e) => {
            let message = e.to_string();
            let err = if e.is_eof() {
                LeaseError::Truncated {
                    path: path.to_path_buf(),
                    message,
                }
            } else {
                LeaseError::NotJson {
                    path: path.to_path_buf(),
                    message,
                }
            };
            return (Err(err), 0);
        }
    };
    let rows = match value {
        serde_json::Value::Null => return (Ok(HashMap::new()), 0),
        serde_json::Value::Array(rows) => rows,
        other => {
            let message = format!("expected an array or null, found {}", json_kind(&other));
            return (
                Err(LeaseError::Schema {
                    path: path.to_path_buf(),
                    message,
                }),
                0,
            );
        }
    };
    let mut table = HashMap::with_capacity(rows.len());
    let mut skipped = 0;
    for row in &rows {
        let Some(lease) = parse_row(row) else {
            skipped += 1;
            continue;
        };
        match table.get_mut(&lease.mac) {
            None => {
                table.insert(lease.mac.clone(), Row::One(lease));
            }
            Some(existing) => *existing = Row::Duplicate,
        }
    }
    (Ok(table), skipped)
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn parse_row(row: &serde_json::Value) -> Option<Lease> {
    let mac = normalize_mac(row.get("mac")?.as_str()?)?;
    let ip = row.get("ip")?.as_str()?.trim().parse::<Ipv4Addr>().ok()?;
    let expiry = crate::rfc3339::parse(row.get("expiry")?.as_str()?)?;
    Some(Lease { mac, ip, expiry })
}

/// Parse a MAC written as six hex pairs separated by `:` or `-` (any case) and print it in
/// the lower-case colon form cocoon-net uses. `None` when it is not a 48-bit MAC.
pub fn normalize_mac(text: &str) -> Option<String> {
    let text = text.trim();
    let parts: Vec<&str> = text.split([':', '-']).collect();
    if parts.len() != 6 {
        return None;
    }
    let mut out = String::with_capacity(17);
    for (i, part) in parts.iter().enumerate() {
        if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        if i > 0 {
            out.push(':');
        }
        out.push_str(&part.to_ascii_lowercase());
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn rfc3339_offsets_fractions_and_rejects() {
        // 2026-08-01T04:00:00Z = 1785556800
        assert_eq!(
            crate::rfc3339::parse("2026-08-01T12:00:00+08:00"),
            Some(at(1_785_556_800))
        );
        assert_eq!(
            crate::rfc3339::parse("2026-08-01T04:00:00Z"),
            Some(at(1_785_556_800))
        );
        assert_eq!(
            crate::rfc3339::parse("2026-07-31T23:30:00-04:30"),
            Some(at(1_785_556_800))
        );
        assert_eq!(
            crate::rfc3339::parse("2026-08-01T04:00:00.25Z"),
            Some(at(1_785_556_800) + Duration::from_millis(250))
        );
        assert_eq!(
            crate::rfc3339::parse("1970-01-01T00:00:00Z"),
            Some(UNIX_EPOCH)
        );
        assert_eq!(
            crate::rfc3339::parse("2024-02-29T00:00:00Z"),
            Some(at(1_709_164_800))
        );
        for bad in [
            "",
            "2026-08-01",
            "2026-08-01T12:00:00",
            "2026-13-01T12:00:00Z",
            "2025-02-29T00:00:00Z",
            "2026-08-01T24:00:00Z",
            "2026-08-01T12:00:00+8:00",
            "2026-08-01T12:00:00.Z",
            "2026-08-01T12:00:00Zjunk",
            "２026-08-01T12:00:00Z",
            "abcd-ef-ghTij:kl:mnZ",
        ] {
            assert_eq!(crate::rfc3339::parse(bad), None, "{bad:?} should not parse");
        }
    }

    #[test]
    fn mac_normalisation() {
        assert_eq!(
            normalize_mac(" 02:00:0A:00:00:05 ").as_deref(),
            Some("02:00:0a:00:00:05")
        );
        assert_eq!(
            normalize_mac("02-00-0a-00-00-05").as_deref(),
            Some("02:00:0a:00:00:05")
        );
        for bad in [
            "",
            "02:00:0a:00:00",
            "02:00:0a:00:00:05:06",
            "0g:00:0a:00:00:05",
            "2:0:a:0:0:5",
        ] {
            assert_eq!(normalize_mac(bad), None, "{bad:?}");
        }
    }

    fn table(text: &str) -> (Table, usize) {
        parse_table(Path::new("/t"), text.as_bytes())
    }

    #[test]
    fn file_level_errors_are_typed() {
        assert!(matches!(table("").0, Err(LeaseError::Empty { .. })));
        assert!(matches!(table(" \n").0, Err(LeaseError::Empty { .. })));
        assert!(matches!(
            table("[{\"mac\":\"02:00").0,
            Err(LeaseError::Truncated { .. })
        ));
        assert!(matches!(table("<html>").0, Err(LeaseError::NotJson { .. })));
        assert!(matches!(
            table("{\"mac\":1}").0,
            Err(LeaseError::Schema { .. })
        ));
        assert!(matches!(table("null").0, Ok(ref t) if t.is_empty()));
        assert!(matches!(table("[]").0, Ok(ref t) if t.is_empty()));
    }

    #[test]
    fn bad_rows_are_skipped_and_duplicates_marked() {
        let (t, skipped) = table(
            r#"[{"mac":"02:00:0A:00:00:05","ip":"10.88.0.5","expiry":"2026-08-01T12:00:00+08:00"},
                {"mac":"02:00:0a:00:00:06","ip":"10.88.0.6","expiry":"tomorrow"},
                {"mac":"02:00:0a:00:00:07","ip":"10.88.0.300","expiry":"2026-08-01T12:00:00Z"},
                {"mac":"nope","ip":"10.88.0.8","expiry":"2026-08-01T12:00:00Z"},
                7,
                {"mac":"02:00:0a:00:00:09","ip":"10.88.0.9","expiry":"2026-08-01T12:00:00Z"},
                {"mac":"02:00:0a:00:00:09","ip":"10.88.0.10","expiry":"2026-08-01T12:00:00Z"}]"#,
        );
        let t = t.unwrap();
        assert_eq!(skipped, 4);
        assert!(
            matches!(t.get("02:00:0a:00:00:05"), Some(Row::One(l)) if l.ip == Ipv4Addr::new(10, 88, 0, 5))
        );
        assert!(matches!(t.get("02:00:0a:00:00:09"), Some(Row::Duplicate)));
        assert_eq!(t.len(), 2);
    }
}
