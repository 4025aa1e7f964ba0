//! The push spool: the daemon's private directory and the unlinked 0600 files in it.
//! Files too big to hold in memory pass through here, hashed as they are written.

use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use sha2::{Digest as _, Sha256};

use super::READ_BUF;
use crate::snapshots::client::RegistryClient;
use crate::snapshots::reference::hex_lower;
use crate::snapshots::tarstream::TarReader;
use crate::snapshots::TransferError;

/// Why the spool directory cannot be used; the message names the directory.
#[derive(Debug)]
pub struct SpoolDirError {
    pub dir: PathBuf,
    pub problem: SpoolDirProblem,
}

/// What is wrong with the spool directory.
#[derive(Debug)]
pub enum SpoolDirProblem {
    /// Creating, inspecting or narrowing it failed.
    Io(io::Error),
    /// A symlink (never followed) or something other than a directory.
    NotADirectory,
    /// Owned by another user than the daemon's.
    ForeignOwner { uid: u32, ours: u32 },
}

impl fmt::Display for SpoolDirError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "spool directory {}: ", self.dir.display())?;
        match &self.problem {
            SpoolDirProblem::Io(e) => write!(f, "{e}"),
            SpoolDirProblem::NotADirectory => {
                f.write_str("is a symlink or not a directory; remove it (vk-cocoon creates it)")
            }
            SpoolDirProblem::ForeignOwner { uid, ours } => write!(
                f,
                "is owned by uid {uid}, not by vk-cocoon's uid {ours}; remove it (vk-cocoon \
                 creates it)"
            ),
        }
    }
}

impl std::error::Error for SpoolDirError {}

/// Makes `dir` the daemon's private spool directory: created with mode 0700 when missing; an
/// existing one must be a real directory (not a symlink) owned by this process's user, and is
/// narrowed to 0700 when it allows more. A snapshot layer passes through the spool: guest memory
/// and disk that no other user of the host may read.
pub fn prepare_spool_dir(dir: &Path) -> Result<(), SpoolDirError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let fail = |problem| SpoolDirError {
        dir: dir.to_path_buf(),
        problem,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(fail(SpoolDirProblem::Io(e))),
    }
    // lstat: a symlink is refused, never followed.
    let meta = std::fs::symlink_metadata(dir).map_err(|e| fail(SpoolDirProblem::Io(e)))?;
    if meta.file_type().is_symlink() || !meta.is_dir() {
        return Err(fail(SpoolDirProblem::NotADirectory));
    }
    let uid = rustix::process::geteuid().as_raw();
    if meta.uid() != uid {
        return Err(fail(SpoolDirProblem::ForeignOwner {
            uid: meta.uid(),
            ours: uid,
        }));
    }
    if meta.mode() & 0o777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| fail(SpoolDirProblem::Io(e)))?;
    }
    Ok(())
}

/// An unlinked temporary file (prefix `cocoon-snapshot-`), mode 0600: removed from the
/// directory right after creation, so nothing is left behind whatever happens to the push.
pub(super) struct Spool {
    pub(super) file: File,
    /// Where it lives (named in errors: a full disk there fails the push).
    dir: PathBuf,
}

static SPOOL_SEQ: AtomicU64 = AtomicU64::new(0);

impl Spool {
    /// A write to the spool failed (a full disk, most likely).
    fn write_error(&self, name: &str, e: io::Error) -> TransferError {
        TransferError::Io(format!("spool {name} in {}: {e}", self.dir.display()))
    }

    pub(super) fn create(dir: Option<&Path>) -> Result<Self, TransferError> {
        let dir = dir
            .map(Path::to_path_buf)
            .unwrap_or_else(std::env::temp_dir);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = dir.join(format!(
            "cocoon-snapshot-{}-{}-{nanos}",
            std::process::id(),
            SPOOL_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| TransferError::Io(format!("create spool file {}: {e}", path.display())))?;
        std::fs::remove_file(&path)
            .map_err(|e| TransferError::Io(format!("unlink spool file {}: {e}", path.display())))?;
        Ok(Spool { file, dir })
    }

    /// Raw body straight into one upload (POST, PATCH streaming the tar body, PUT with the
    /// digest computed on the way) while also spooling it, so a failed stream falls back to
    /// the retried file upload. Returns (digest, size, uploaded by the stream).
    pub(super) fn stream_raw<R: Read>(
        &self,
        client: &RegistryClient,
        repository: &str,
        tar: &mut TarReader<R>,
        size: u64,
        name: &str,
    ) -> Result<(String, u64, bool), TransferError> {
        let mut tee = Tee {
            tar,
            spool: io::BufWriter::with_capacity(READ_BUF, &self.file),
            hasher: Sha256::new(),
            count: 0,
            spool_failed: false,
        };
        let attempt = client
            .begin_upload(repository)
            .and_then(|u| client.patch_upload(repository, u, size, &mut tee));
        // Finish reading the body whatever happened, so the hash and the spool are complete;
        // an export stream error here is the real failure.
        let mut buf = vec![0u8; READ_BUF];
        loop {
            let n = match tee.read(&mut buf) {
                Ok(n) => n,
                Err(e) if tee.spool_failed => return Err(self.write_error(name, e)),
                Err(e) => {
                    return Err(TransferError::Format(format!(
                        "{name}: reading export stream: {e}"
                    )))
                }
            };
            if n == 0 {
                break;
            }
        }
        if tee.count != size {
            return Err(TransferError::Format(format!(
                "{name}: body ended after {} of {size} bytes",
                tee.count
            )));
        }
        tee.spool.flush().map_err(|e| self.write_error(name, e))?;
        let digest = format!("sha256:{}", hex_lower(&tee.hasher.finalize()));
        let uploaded = match attempt.and_then(|u| client.finish_upload(repository, u, &digest)) {
            Ok(()) => true,
            Err(e) => {
                log::info!("{name}: streamed upload failed ({e}); retrying from the spool file");
                false
            }
        };
        Ok((digest, size, uploaded))
    }

    /// Copies the body verbatim while hashing; returns (digest, size).
    pub(super) fn write_raw<R: Read>(
        &self,
        tar: &mut TarReader<R>,
        size: u64,
        name: &str,
    ) -> Result<(String, u64), TransferError> {
        let mut w = HashingWriter {
            inner: io::BufWriter::with_capacity(READ_BUF, &self.file),
            hasher: Sha256::new(),
            written: 0,
        };
        let copied = copy_body(tar, &mut w, name, self)?;
        if copied != size {
            return Err(TransferError::Format(format!(
                "{name}: body ended after {copied} of {size} bytes"
            )));
        }
        w.inner.flush().map_err(|e| self.write_error(name, e))?;
        Ok((
            format!("sha256:{}", hex_lower(&w.hasher.finalize())),
            w.written,
        ))
    }

    /// Streams the body through one zstd encoder (pledged size) while hashing the output.
    pub(super) fn write_compressed<R: Read>(
        &self,
        tar: &mut TarReader<R>,
        size: u64,
        level: i32,
        name: &str,
    ) -> Result<(String, u64), TransferError> {
        let w = HashingWriter {
            inner: io::BufWriter::with_capacity(READ_BUF, &self.file),
            hasher: Sha256::new(),
            written: 0,
        };
        let zerr = |e: io::Error| TransferError::Io(format!("zstd {name}: {e}"));
        let mut enc = zstd::stream::write::Encoder::new(w, level).map_err(zerr)?;
        enc.set_pledged_src_size(Some(size)).map_err(zerr)?;
        enc.include_contentsize(true).map_err(zerr)?;
        let copied = copy_body(tar, &mut enc, name, self)?;
        if copied != size {
            return Err(TransferError::Format(format!(
                "{name}: body ended after {copied} of {size} bytes"
            )));
        }
        let mut w = enc.finish().map_err(zerr)?;
        w.inner.flush().map_err(|e| self.write_error(name, e))?;
        Ok((
            format!("sha256:{}", hex_lower(&w.hasher.finalize())),
            w.written,
        ))
    }
}

fn copy_body<R: Read, W: Write>(
    tar: &mut TarReader<R>,
    w: &mut W,
    name: &str,
    spool: &Spool,
) -> Result<u64, TransferError> {
    let mut buf = vec![0u8; READ_BUF];
    let mut total = 0u64;
    loop {
        let n = tar
            .read_body(&mut buf)
            .map_err(|e| TransferError::Format(format!("{name}: reading export stream: {e}")))?;
        if n == 0 {
            return Ok(total);
        }
        w.write_all(&buf[..n])
            .map_err(|e| spool.write_error(name, e))?;
        total += n as u64;
    }
}

/// Reads the current tar body, hashing it and copying it into the spool on the way.
struct Tee<'a, R: Read, W: Write> {
    tar: &'a mut TarReader<R>,
    spool: W,
    hasher: Sha256,
    count: u64,
    /// The spool write failed (not the export stream): the error names the spool.
    spool_failed: bool,
}

impl<R: Read, W: Write> Read for Tee<'_, R, W> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.tar.read_body(buf)?;
        if let Err(e) = self.spool.write_all(&buf[..n]) {
            self.spool_failed = true;
            return Err(e);
        }
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

struct HashingWriter<W: Write> {
    inner: W,
    hasher: Sha256,
    written: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o777
    }

    #[test]
    fn the_spool_dir_is_private_and_refused_when_not_the_daemons() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("vk-spool");
        prepare_spool_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        // Too wide (an earlier install, a hand-made dir of ours): narrowed.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare_spool_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        // A symlink is never followed, even to a directory of ours.
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = prepare_spool_dir(&link).unwrap_err().to_string();
        assert!(e.contains("symlink"), "{e}");
        // Another user's directory is refused (only root can hand one over; tests run as root
        // where they can).
        if rustix::process::geteuid().is_root() {
            let theirs = root.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            let e = prepare_spool_dir(&theirs).unwrap_err().to_string();
            assert!(e.contains("owned by uid 65534"), "{e}");
        }
    }

    #[test]
    fn a_spool_file_is_0600_and_already_unlinked() {
        let root = tempfile::tempdir().unwrap();
        let spool = Spool::create(Some(root.path())).unwrap();
        let meta = spool.file.metadata().unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(meta.nlink(), 0, "unlinked at once");
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    }
}
