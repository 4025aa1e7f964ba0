//! The served side's view of the snapshot directory: opening a snapshot's files without ever
//! leaving the directory, and planning which byte ranges of each file carry data.
//!
//! Every name is one plain component opened relative to its parent with `O_NOFOLLOW`, so
//! neither `..` nor a symlink planted anywhere under the directory can reach another file.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{Mode, OFlags, SeekFrom};

use super::wire::{
    plain_component, Plan, PlanFile, Slice, ENVELOPE_NAME, HOLE_COALESCE, MAX_SLICE_LEN,
};

/// Opens `<root>/<id>` as a directory; `id` must be one plain component and not a symlink.
pub fn open_snapshot_dir(root: &Path, id: &str) -> io::Result<OwnedFd> {
    if !plain_component(id) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "bad snapshot id",
        ));
    }
    let root = rustix::fs::open(
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    Ok(rustix::fs::openat(
        &root,
        id,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Opens the regular file `name` directly inside `dir` (no symlink, no other file type).
pub fn open_member(dir: &OwnedFd, name: &str) -> io::Result<File> {
    if !plain_component(name) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad file name"));
    }
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let st = rustix::fs::fstat(&fd)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    // Regular files ignore O_NONBLOCK; it only kept a FIFO from blocking the open.
    Ok(File::from(fd))
}

/// The plan of snapshot `id` under `root`: every regular data file (sorted by name) with its
/// data ranges. Entries that are not plain regular files are left out.
pub fn build_plan(root: &Path, id: &str) -> io::Result<Plan> {
    let dir = open_snapshot_dir(root, id)?;
    let listing = rustix::fs::openat(
        &dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::read_from(&listing)? {
        let entry = entry?;
        let Ok(name) = entry.file_name().to_str() else {
            continue;
        };
        if plain_component(name) && name != ENVELOPE_NAME {
            names.push(name.to_string());
        }
    }
    names.sort();
    let mut files = Vec::new();
    for name in names {
        let Ok(file) = open_member(&dir, &name) else {
            continue;
        };
        let size = file.metadata()?.len();
        let slices = split(coalesce(data_regions(&file, size)?));
        files.push(PlanFile { name, size, slices });
    }
    Ok(Plan {
        snapshot_id: id.to_string(),
        files,
    })
}

/// The `[start, end)` ranges of `file` that hold data, by SEEK_DATA / SEEK_HOLE; the whole file
/// when the filesystem cannot tell.
fn data_regions(file: &File, size: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        let start = match rustix::fs::seek(file, SeekFrom::Data(pos)) {
            Ok(s) => s,
            Err(rustix::io::Errno::NXIO) => break,
            Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::OPNOTSUPP) => {
                return Ok(vec![(0, size)]);
            }
            Err(e) => return Err(e.into()),
        };
        if start >= size {
            break;
        }
        let end = match rustix::fs::seek(file, SeekFrom::Hole(start)) {
            Ok(e) => e.min(size),
            Err(_) => size,
        };
        if end <= start {
            break;
        }
        out.push((start, end));
        pos = end;
    }
    Ok(out)
}

/// Merges ranges separated by holes of at most `HOLE_COALESCE` bytes.
fn coalesce(regions: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(regions.len());
    for (s, e) in regions {
        match out.last_mut() {
            Some(last) if s.saturating_sub(last.1) <= HOLE_COALESCE => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Cuts ranges into slices of at most `MAX_SLICE_LEN` bytes.
fn split(regions: Vec<(u64, u64)>) -> Vec<Slice> {
    let mut out = Vec::new();
    for (mut s, e) in regions {
        while s < e {
            let length = (e - s).min(MAX_SLICE_LEN);
            out.push(Slice { offset: s, length });
            s += length;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, Write};

    #[test]
    fn ranges_coalesce_small_holes_and_split_long_runs() {
        let mib = 1u64 << 20;
        let c = coalesce(vec![(0, mib), (3 * mib, 4 * mib), (20 * mib, 21 * mib)]);
        assert_eq!(c, vec![(0, 4 * mib), (20 * mib, 21 * mib)]);
        let s = split(vec![(0, 600 * mib)]);
        assert_eq!(
            s.iter().map(|s| s.length / mib).collect::<Vec<_>>(),
            vec![256, 256, 88]
        );
        assert_eq!(s[2].offset, 512 * mib);
    }

    #[test]
    fn plan_lists_regular_files_and_skips_holes_symlinks_and_the_envelope() {
        let root = tempfile::tempdir().unwrap();
        let snap = root.path().join("SNAP1");
        std::fs::create_dir(&snap).unwrap();
        let mut mem = File::create(snap.join("memory-ranges")).unwrap();
        mem.write_all(b"head").unwrap();
        mem.seek(std::io::SeekFrom::Start(64 << 20)).unwrap();
        mem.write_all(b"tail").unwrap();
        std::fs::write(snap.join("config.json"), b"{}").unwrap();
        std::fs::write(snap.join(ENVELOPE_NAME), b"{}").unwrap();
        std::fs::write(root.path().join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink(root.path().join("secret"), snap.join("link")).unwrap();
        std::fs::create_dir(snap.join("sub")).unwrap();

        let plan = build_plan(root.path(), "SNAP1").unwrap();
        let names: Vec<_> = plan.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, vec!["config.json", "memory-ranges"]);
        let mem = &plan.files[1];
        assert_eq!(mem.size, (64 << 20) + 4);
        // Both data ends are sent; the 64 MiB hole between them is not (on filesystems that
        // report holes; otherwise the whole file is one range).
        let sent: u64 = mem.slices.iter().map(|s| s.length).sum();
        assert!(mem.slices.first().unwrap().offset == 0);
        assert!(sent == mem.size || sent < 16 << 20, "sent {sent}");

        assert!(build_plan(root.path(), "..").is_err());
        std::os::unix::fs::symlink(&snap, root.path().join("alias")).unwrap();
        assert!(build_plan(root.path(), "alias").is_err());
        let dir = open_snapshot_dir(root.path(), "SNAP1").unwrap();
        assert!(open_member(&dir, "link").is_err());
        assert!(open_member(&dir, "../secret").is_err());
        assert!(open_member(&dir, "sub").is_err());
    }
}
