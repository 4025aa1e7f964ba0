//! Pull, planning: which import-tar entries the layers make, and how many chunks may be in
//! flight within the memory budget.

use std::collections::HashMap;

use oci_spec::image::{Descriptor, ImageManifest};

use crate::snapshots::format::{self, SnapshotConfig};
use crate::snapshots::TransferError;

use super::*;

/// One import-tar entry planned from the layers.
pub(super) enum PlanEntry {
    Raw {
        title: String,
        desc: Box<Descriptor>,
    },
    Encoded {
        title: String,
        chunks: Vec<Descriptor>,
        compressed: bool,
        size: u64,
    },
}

pub(super) fn title_of(d: &Descriptor) -> Option<String> {
    d.annotations()
        .as_ref()
        .and_then(|a| a.get(format::TITLE))
        .filter(|t| !t.is_empty())
        .cloned()
}

/// Validation and planning.
pub(super) fn plan(
    m: &ImageManifest,
    cfg: &SnapshotConfig,
    v2: bool,
    what: &str,
) -> Result<Vec<PlanEntry>, TransferError> {
    if (cfg.schema_version == "v2") != v2 {
        return Err(TransferError::Format(format!(
            "{what}: config schemaVersion {:?} disagrees with the artifactType",
            cfg.schema_version
        )));
    }
    for d in m.layers() {
        let mt = d.media_type().to_string();
        let base = mt.strip_suffix("+zstd").unwrap_or(&mt);
        if !format::SNAPSHOT_LAYER_TYPES.contains(&base) {
            return Err(TransferError::Format(format!(
                "{what}: layer {} has media type {mt}: snapshot needs a newer reader",
                d.digest()
            )));
        }
        if mt.ends_with("+zstd") && !v2 {
            return Err(TransferError::Format(format!(
                "{what}: layer {} is zstd-encoded in a v1 snapshot",
                d.digest()
            )));
        }
        let title = title_of(d).ok_or_else(|| {
            TransferError::Format(format!("{what}: layer {} has no title", d.digest()))
        })?;
        if !format::safe_layer_title(&title) {
            return Err(TransferError::Format(format!(
                "{what}: layer {} has an unsafe title {title:?}",
                d.digest()
            )));
        }
    }
    if !v2 && cfg.files.values().any(|f| !f.chunks.is_empty()) {
        return Err(TransferError::Format(format!(
            "{what}: files[].chunks in a v1 snapshot"
        )));
    }
    let by_digest: HashMap<String, &Descriptor> = m
        .layers()
        .iter()
        .map(|d| (d.digest().to_string(), d))
        .collect();
    let mut out = Vec::new();
    let mut seen_encoded: Vec<String> = Vec::new();
    for d in m.layers() {
        let title = title_of(d).unwrap_or_default();
        let file = cfg.files.get(&title).cloned().unwrap_or_default();
        let zstd = d.media_type().to_string().ends_with("+zstd");
        if file.chunks.is_empty() && !zstd {
            out.push(PlanEntry::Raw {
                title,
                desc: Box::new(d.clone()),
            });
            continue;
        }
        if seen_encoded.contains(&title) {
            continue;
        }
        seen_encoded.push(title.clone());
        if file.size <= 0 {
            return Err(TransferError::Format(format!(
                "{what}: encoded layer missing files[].size for {title}"
            )));
        }
        let chunks = if file.chunks.is_empty() {
            vec![d.clone()]
        } else {
            file.chunks
                .iter()
                .map(|c| {
                    by_digest.get(c).map(|d| (*d).clone()).ok_or_else(|| {
                        TransferError::Format(format!(
                            "{what}: chunk {c} of {title} missing from manifest layers"
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        out.push(PlanEntry::Encoded {
            title,
            chunks,
            compressed: zstd,
            size: file.size as u64,
        });
    }
    Ok(out)
}

fn stride(size: u64, n: u64) -> u64 {
    if n <= 1 {
        size
    } else {
        (size - 1) / (n - 1) + 1
    }
}

/// Prefetch window and per-chunk output cap; window < 2 means sequential.
pub(super) fn window(entries: &[PlanEntry], concurrency: usize, budget: u64) -> (usize, u64) {
    let (mut out_cap, mut in_cap) = (0u64, 0u64);
    for e in entries {
        if let PlanEntry::Encoded {
            chunks,
            compressed,
            size,
            ..
        } = e
        {
            let largest = chunks.iter().map(|c| c.size()).max().unwrap_or(0);
            let o = if *compressed {
                stride(*size, chunks.len() as u64)
            } else {
                largest
            };
            let i = if *compressed { largest } else { 0 };
            out_cap = out_cap.max(o);
            in_cap = in_cap.max(i);
        }
    }
    if out_cap == 0 || out_cap > GIB || in_cap > GIB || budget <= out_cap {
        return (0, out_cap);
    }
    let w = ((budget - out_cap) / (in_cap + out_cap)).min(concurrency as u64);
    // However large the budget, chunks in flight stay within PREFETCH_CAP (peak RSS must not
    // grow with the snapshot or the chunk count); two are enough to keep the pipe busy.
    let by_cap = (PREFETCH_CAP / (in_cap + out_cap)).max(2);
    (w.min(by_cap) as usize, out_cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stride_and_window() {
        assert_eq!(stride(10, 1), 10);
        assert_eq!(stride(10, 3), 5);
        assert_eq!(stride(9, 3), 5);
        let d = |size: u64| {
            Descriptor::new(
                oci_spec::image::MediaType::from("application/vnd.cocoonstack.vm.memory+zstd"),
                size,
                format!("sha256:{}", "a".repeat(64))
                    .parse::<oci_spec::image::Digest>()
                    .unwrap(),
            )
        };
        let e = vec![PlanEntry::Encoded {
            title: "m".into(),
            chunks: vec![d(10 * MIB), d(10 * MIB), d(5 * MIB)],
            compressed: true,
            size: 150 * MIB,
        }];
        // out cap = stride(150 MiB, 3) = 75 MiB, in cap = 10 MiB: (2048-75)/85 = 23 → min(8),
        // then the 32 MiB prefetch cap leaves the minimum of two.
        assert_eq!(window(&e, 8, 2048 * MIB).0, 2);
        assert_eq!(window(&e, 8, 200 * MIB).0, 1);
        // 4 MiB chunks: in cap 4 MiB, out cap stride(1 GiB, 256) just above 4 MiB, so
        // 32 MiB holds 3 chunks in flight, not 8.
        let e = vec![PlanEntry::Encoded {
            title: "m".into(),
            chunks: vec![d(4 * MIB); 256],
            compressed: true,
            size: 1024 * MIB,
        }];
        assert_eq!(window(&e, 8, 2048 * MIB).0, 3);
    }
}
