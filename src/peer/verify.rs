//! The staged copy checked against the registry tag it stands in for: every byte of each
//! file must hash to the sha256 layer digests the tag's manifest lists for that file.
//!
//! CRC-32C per slice catches a damaged transfer, not a peer that lies: it computes the
//! checksum of whatever it sends. The layer digests come from the registry, so a copy that
//! passes here is the very content a registry pull would have imported. A layer's digest
//! covers the file's export-tar body: the whole file, or with a sparse map its packed data
//! regions (the rest must then be zeros); a chunked file has one digest per fixed-size chunk.
//! zstd layers hash compressed bytes no raw copy reproduces, so such a snapshot cannot be
//! checked and is not restored from a peer (the registry pull serves it).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::wire::Slice;
use crate::snapshots::format::{LayerRef, SnapshotConfig};

/// Bytes read per call while hashing.
const READ_BLOCK: usize = 4 << 20;

/// Why a peer copy is refused; the text names the file and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyError {
    /// The registry's manifest cannot vouch for a raw copy (no layers, a zstd layer, a digest
    /// that is not sha256, inconsistent sizes or sparse map): the peer is not used.
    Uncheckable(String),
    /// A staged file could not be read back.
    Read(String),
    /// A staged file's bytes are not the registry layers' bytes.
    Mismatch(String),
}

impl std::fmt::Display for VerifyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VerifyError::Uncheckable(m) | VerifyError::Read(m) | VerifyError::Mismatch(m) => {
                f.write_str(m)
            }
        }
    }
}

impl std::error::Error for VerifyError {}

/// What one staged file must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileCheck {
    /// The file's length on disk (the sparse size of a sparse file).
    pub logical_size: u64,
    /// `[offset, offset + length)` ranges whose concatenation is the tar body, in order.
    regions: Vec<(u64, u64)>,
    /// The body's consecutive pieces: (sha256 hex, length).
    pieces: Vec<(String, u64)>,
}

#[derive(Deserialize)]
struct SparseRegion {
    o: u64,
    l: u64,
}

/// The check of every file the manifest lists, by name. Fails when any file cannot be checked
/// (a zstd layer, a digest that is not sha256, inconsistent sizes): the peer is then not used.
pub fn expectations(
    cfg: &SnapshotConfig,
    layers: &[LayerRef],
) -> Result<BTreeMap<String, FileCheck>, VerifyError> {
    let no = VerifyError::Uncheckable;
    if layers.is_empty() {
        return Err(no(
            "the registry manifest lists no layers to check a peer copy against".into(),
        ));
    }
    let by_digest: HashMap<&str, &LayerRef> =
        layers.iter().map(|l| (l.digest.as_str(), l)).collect();
    let mut out = BTreeMap::new();
    for layer in layers {
        let title = layer.title.as_str();
        if out.contains_key(title) {
            continue;
        }
        let same: Vec<&LayerRef> = layers.iter().filter(|l| l.title == title).collect();
        if let Some(z) = same.iter().find(|l| l.media_type.ends_with("+zstd")) {
            return Err(no(format!(
                "{title}: layer {} is zstd-encoded; a raw peer copy cannot be checked against it",
                z.digest
            )));
        }
        let meta = cfg.files.get(title).cloned().unwrap_or_default();
        let pieces: Vec<(String, u64)> = if meta.chunks.is_empty() {
            if same.len() != 1 {
                return Err(no(format!("{title}: {} unchunked layers", same.len())));
            }
            vec![(sha256_hex(&layer.digest, title)?, layer.size)]
        } else {
            meta.chunks
                .iter()
                .map(|c| {
                    let l = by_digest
                        .get(c.as_str())
                        .ok_or_else(|| no(format!("{title}: chunk {c} is not a manifest layer")))?;
                    Ok((sha256_hex(c, title)?, l.size))
                })
                .collect::<Result<_, VerifyError>>()?
        };
        let body = pieces
            .iter()
            .try_fold(0u64, |a, (_, n)| a.checked_add(*n))
            .ok_or_else(|| no(format!("{title}: layer sizes overflow")))?;
        if meta.size > 0 && meta.size as u64 != body {
            return Err(no(format!(
                "{title}: the config says {} bytes, its layers hold {body}",
                meta.size
            )));
        }
        let (regions, logical_size) = if meta.sparse_map.is_empty() {
            (vec![(0, body)], body)
        } else {
            sparse_regions(&meta.sparse_map, meta.sparse_size, body, title)?
        };
        out.insert(
            title.to_string(),
            FileCheck {
                logical_size,
                regions,
                pieces,
            },
        );
    }
    Ok(out)
}

/// The hex part of a `sha256:` digest; any other algorithm cannot be checked here.
fn sha256_hex(digest: &str, title: &str) -> Result<String, VerifyError> {
    match digest.strip_prefix("sha256:") {
        Some(h) if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Ok(h.to_ascii_lowercase())
        }
        _ => Err(VerifyError::Uncheckable(format!(
            "{title}: digest {digest:?} is not a sha256 digest"
        ))),
    }
}

/// A sparse map's data regions: in order, not overlapping, inside the sparse size, and
/// together exactly as long as the body.
fn sparse_regions(
    map: &str,
    sparse_size: i64,
    body: u64,
    title: &str,
) -> Result<(Vec<(u64, u64)>, u64), VerifyError> {
    let bad = |why: &str| VerifyError::Uncheckable(format!("{title}: sparse map {why}"));
    if sparse_size <= 0 {
        return Err(bad("without a sparse size"));
    }
    let parsed: Vec<SparseRegion> =
        serde_json::from_str(map).map_err(|e| bad(&format!("unreadable: {e}")))?;
    let mut regions = Vec::with_capacity(parsed.len());
    let (mut end, mut total) = (0u64, 0u64);
    for r in parsed {
        let stop = r.o.checked_add(r.l).ok_or_else(|| bad("overflows"))?;
        if r.o < end || stop > sparse_size as u64 {
            return Err(bad("regions overlap or pass the sparse size"));
        }
        if r.l > 0 {
            regions.push((r.o, r.l));
        }
        end = stop;
        total += r.l;
    }
    if total != body {
        return Err(bad(&format!(
            "covers {total} bytes, the layers hold {body}"
        )));
    }
    Ok((regions, sparse_size as u64))
}

/// Checks `file` (staged, `written` being the slices the peer sent into it; the rest was
/// never written and reads as zeros) against `check`.
pub fn verify(
    file: &File,
    check: &FileCheck,
    written: &[Slice],
    name: &str,
) -> Result<(), VerifyError> {
    let len = file
        .metadata()
        .map_err(|e| VerifyError::Read(format!("{name}: {e}")))?
        .len();
    if len != check.logical_size {
        return Err(VerifyError::Mismatch(format!(
            "{name}: {len} bytes staged, the registry says {}",
            check.logical_size
        )));
    }
    let mut pieces = check.pieces.iter();
    let mut current = pieces.next();
    let mut left = current.map_or(0, |p| p.1);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; READ_BLOCK];
    let finish = |hasher: &mut Sha256, want: &str| -> Result<(), VerifyError> {
        let got = hex(&hasher.finalize_reset());
        if got != want {
            return Err(VerifyError::Mismatch(format!(
                "{name}: sha256 {got} but the registry layer is {want}: the peer sent other bytes"
            )));
        }
        Ok(())
    };
    for &(offset, length) in &check.regions {
        let mut at = offset;
        let end = offset + length;
        while at < end {
            // Empty pieces (an empty file) are finished before reading on.
            while left == 0 {
                let Some(p) = current else {
                    return Err(VerifyError::Mismatch(format!(
                        "{name}: more data than the layers hold"
                    )));
                };
                finish(&mut hasher, &p.0)?;
                current = pieces.next();
                left = current.map_or(0, |p| p.1);
            }
            let n = (end - at).min(left).min(READ_BLOCK as u64) as usize;
            file.read_exact_at(&mut buf[..n], at)
                .map_err(|e| VerifyError::Read(format!("{name}: read at {at}: {e}")))?;
            hasher.update(&buf[..n]);
            at += n as u64;
            left -= n as u64;
        }
    }
    while let Some(p) = current {
        if left != 0 {
            return Err(VerifyError::Mismatch(format!(
                "{name}: fewer data bytes than the layers hold"
            )));
        }
        finish(&mut hasher, &p.0)?;
        current = pieces.next();
        left = current.map_or(0, |p| p.1);
    }
    zeros_outside(file, &check.regions, written, &mut buf, name)
}

/// Every written byte outside the data regions must be zero: those bytes are in no digest.
fn zeros_outside(
    file: &File,
    regions: &[(u64, u64)],
    written: &[Slice],
    buf: &mut [u8],
    name: &str,
) -> Result<(), VerifyError> {
    for s in written {
        let (mut at, end) = (s.offset, s.offset + s.length);
        while at < end {
            // The region holding `at`, or the next one after it.
            let next = regions.iter().find(|(o, l)| o + l > at);
            let gap_end = match next {
                Some(&(o, l)) if o <= at => {
                    at = (o + l).min(end);
                    continue;
                }
                Some(&(o, _)) => o.min(end),
                None => end,
            };
            while at < gap_end {
                let n = (gap_end - at).min(buf.len() as u64) as usize;
                file.read_exact_at(&mut buf[..n], at)
                    .map_err(|e| VerifyError::Read(format!("{name}: read at {at}: {e}")))?;
                if buf[..n].iter().any(|b| *b != 0) {
                    return Err(VerifyError::Mismatch(format!(
                        "{name}: data near offset {at} lies outside the sparse map's regions"
                    )));
                }
                at += n as u64;
            }
        }
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshots::format::SnapshotFile;
    use std::io::Write;

    fn digest(data: &[u8]) -> String {
        format!("sha256:{}", hex(&Sha256::digest(data)))
    }

    fn layer(title: &str, data: &[u8]) -> LayerRef {
        LayerRef {
            title: title.into(),
            digest: digest(data),
            size: data.len() as u64,
            media_type: "application/vnd.cocoonstack.vm.memory".into(),
        }
    }

    fn staged(data: &[u8]) -> (tempfile::NamedTempFile, Vec<Slice>) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(data).unwrap();
        let all = vec![Slice {
            offset: 0,
            length: data.len() as u64,
        }];
        (f, all)
    }

    #[test]
    fn a_whole_file_layer_accepts_its_bytes_and_refuses_others() {
        let data = b"guest memory".to_vec();
        let cfg = SnapshotConfig::default();
        let checks = expectations(&cfg, &[layer("memory-ranges", &data)]).unwrap();
        let check = &checks["memory-ranges"];
        let (f, w) = staged(&data);
        verify(f.as_file(), check, &w, "memory-ranges").unwrap();
        let (f, w) = staged(b"guest memorY");
        let err = verify(f.as_file(), check, &w, "memory-ranges")
            .unwrap_err()
            .to_string();
        assert!(err.contains("sha256"), "{err}");
        let (f, w) = staged(b"guest memory!");
        assert!(verify(f.as_file(), check, &w, "memory-ranges").is_err());
    }

    #[test]
    fn chunks_are_checked_each_against_its_own_digest() {
        let (a, b) = (vec![1u8; 10], vec![2u8; 4]);
        let mut cfg = SnapshotConfig::default();
        cfg.files.insert(
            "overlay.qcow2".into(),
            SnapshotFile {
                size: 14,
                chunks: vec![digest(&a), digest(&b)],
                ..Default::default()
            },
        );
        let layers = [layer("overlay.qcow2", &a), layer("overlay.qcow2", &b)];
        let checks = expectations(&cfg, &layers).unwrap();
        let whole: Vec<u8> = a.iter().chain(&b).copied().collect();
        let (f, w) = staged(&whole);
        verify(f.as_file(), &checks["overlay.qcow2"], &w, "o").unwrap();
        // Same length, the second chunk's bytes swapped into the first.
        let mut swapped = whole.clone();
        swapped[9] = 2;
        let (f, w) = staged(&swapped);
        assert!(verify(f.as_file(), &checks["overlay.qcow2"], &w, "o").is_err());
    }

    #[test]
    fn a_sparse_file_hashes_its_regions_and_allows_only_zeros_elsewhere() {
        // Logical 32 bytes: data at [4, 8) and [20, 24).
        let body = b"AAAABBBB".to_vec();
        let mut cfg = SnapshotConfig::default();
        cfg.files.insert(
            "memory-ranges".into(),
            SnapshotFile {
                sparse_map: r#"[{"o":4,"l":4},{"o":20,"l":4}]"#.into(),
                sparse_size: 32,
                ..Default::default()
            },
        );
        let checks = expectations(&cfg, &[layer("memory-ranges", &body)]).unwrap();
        let check = &checks["memory-ranges"];
        assert_eq!(check.logical_size, 32);
        let mut logical = vec![0u8; 32];
        logical[4..8].copy_from_slice(b"AAAA");
        logical[20..24].copy_from_slice(b"BBBB");
        let (f, w) = staged(&logical);
        verify(f.as_file(), check, &w, "m").unwrap();
        // A byte planted in a hole is in no digest: refused.
        logical[12] = 1;
        let (f, w) = staged(&logical);
        let err = verify(f.as_file(), check, &w, "m").unwrap_err().to_string();
        assert!(err.contains("outside"), "{err}");
    }

    #[test]
    fn what_cannot_be_checked_is_refused_up_front() {
        let cfg = SnapshotConfig::default();
        assert!(expectations(&cfg, &[]).is_err());
        let mut z = layer("memory-ranges", b"x");
        z.media_type.push_str("+zstd");
        assert!(expectations(&cfg, &[z]).is_err());
        let mut other = layer("memory-ranges", b"x");
        other.digest = format!("sha512:{}", "0".repeat(128));
        assert!(expectations(&cfg, &[other]).is_err());
        let mut sized = SnapshotConfig::default();
        sized.files.insert(
            "memory-ranges".into(),
            SnapshotFile {
                size: 2,
                ..Default::default()
            },
        );
        assert!(expectations(&sized, &[layer("memory-ranges", b"x")]).is_err());
    }
}
