//! The fake's `snapshot` and `image` verbs: save/inspect/rm/list/import/export, pull/inspect/import.
//! Archives use the 4.6 layout (`snapshot.json` envelope first); data streams are never buffered whole.
//!
//! snapshot: save, inspect, rm, list and the export leases; archive: snapshot import and
//! export with their staging; image: the image verbs. Dispatch and input helpers stay here.

use super::store::Store;
use super::{CmdResult, VerbFault};
use std::fs;
use std::io::{self, BufRead, BufReader, Read};

mod archive;
mod image;
mod snapshot;

use archive::{snap_export, snap_import, sweep_stale_imports};
use image::{image_import, image_inspect, image_list, image_rm, pull};
use snapshot::{save, snap_inspect, snap_list, snap_rm};

pub const SNAPSHOT_VERBS: &[&str] = &["save", "inspect", "rm", "list", "ls", "import", "export"];
pub const IMAGE_VERBS: &[&str] = &["pull", "inspect", "import", "list", "ls", "rm"];

pub fn snapshot(store: &Store, verb: &str, args: &[String], fault: &VerbFault) -> CmdResult {
    sweep_stale_imports(store);
    match verb {
        "save" => save(store, args, fault),
        "inspect" => snap_inspect(store, args),
        "rm" => snap_rm(store, args),
        "list" | "ls" => snap_list(store, args),
        "import" => snap_import(store, args, discard_mode()),
        "export" => snap_export(store, args, fault.truncate_after),
        _ => Ok(0),
    }
}

pub fn image(store: &Store, verb: &str, args: &[String]) -> CmdResult {
    match verb {
        "pull" => pull(store, args),
        "inspect" => image_inspect(store, args),
        "import" => image_import(store, args, discard_mode()),
        "list" | "ls" => image_list(store, args),
        "rm" => image_rm(store, args),
        _ => Ok(0),
    }
}

fn memory_file_size() -> usize {
    std::env::var("FAKE_COCOON_SNAPSHOT_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256 << 10)
}

/// A name must be a plain file name inside an archive or snapshot directory.
fn safe_member(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

/// Opens the import input: a file or stdin, transparently gunzipped (magic `1f 8b`).
fn open_input(file: Option<&str>) -> Result<Box<dyn Read>, String> {
    let raw: Box<dyn Read> = match file {
        Some(f) if f != "-" => Box::new(fs::File::open(f).map_err(|e| format!("open {f}: {e}"))?),
        _ => Box::new(io::stdin().lock()),
    };
    let mut buffered = BufReader::with_capacity(64 << 10, raw);
    let head = buffered.fill_buf().map_err(super::io_err("read input"))?;
    if head.len() >= 2 && head[0] == 0x1f && head[1] == 0x8b {
        Ok(Box::new(flate2::read::MultiGzDecoder::new(buffered)))
    } else {
        Ok(Box::new(buffered))
    }
}

fn drain(input: &mut dyn Read) {
    let _ = io::copy(input, &mut io::sink());
}

/// `FAKE_COCOON_IMPORT_DISCARD=1`: `snapshot import` and `image import` check the stream's
/// framing and keep nothing, so a benchmark measures the transport rather than the disk.
fn discard_mode() -> bool {
    std::env::var("FAKE_COCOON_IMPORT_DISCARD").as_deref() == Ok("1")
}
