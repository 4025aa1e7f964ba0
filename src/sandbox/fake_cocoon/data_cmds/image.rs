//! `image pull | inspect | import | list | rm`: images are records named by the digest of
//! what was pulled or imported.

use super::super::cli::{self, flag, flag_s, val, val_s};
use super::super::store::{now_rfc3339, Store};
use super::super::{io_err, print_json, CmdResult};
use super::archive::discard_archive;
use super::{drain, open_input};
use crate::vm::types::Image;
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{self, Read};

fn image_id_for(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

pub(super) fn pull(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[flag("force"), val_s("output", 'o')])?;
    let r = p.one_positional()?;
    let cloud = r.starts_with("http://") || r.starts_with("https://");
    if store.resolve_image(r).is_some() && !p.has("force") {
        println!("{r}: up to date");
        return Ok(0);
    }
    if cloud {
        print!("\rDownloading {r}:  50%");
        print!("\rDownloading {r}: 100%\n");
    }
    let img = Image {
        id: image_id_for(r.as_bytes()),
        name: r.clone(),
        kind: if cloud { "cloudimg" } else { "oci" }.into(),
        size: 64 << 20,
        created_at: Some(now_rfc3339()),
    };
    let _guard = store.lock().map_err(io_err("lock"))?;
    store.save_image(&img).map_err(io_err("save image"))?;
    Ok(0)
}

pub(super) fn image_inspect(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o')])?;
    let r = p.one_positional()?;
    let img = store
        .resolve_image(r)
        .ok_or_else(|| format!("image \"{r}\": not found in any backend"))?;
    print_json(&img)
}

/// `image import` in discard mode: a tar (OCI) image has its framing checked, a qcow2 image is
/// read to EOF; nothing is stored or registered.
fn discard_image(input: &mut dyn Read) -> CmdResult {
    let mut head = Vec::with_capacity(512);
    input
        .take(512)
        .read_to_end(&mut head)
        .map_err(io_err("import: read input"))?;
    let mut whole = io::Cursor::new(head.clone()).chain(input);
    if head.len() >= 262 && &head[257..262] == b"ustar" {
        let (members, bytes) = discard_archive(&mut whole, false)?;
        drain(&mut whole);
        eprintln!("discarded image archive: {members} members, {bytes} bytes");
        return Ok(0);
    }
    if !head.starts_with(b"QFI\xfb") {
        return Err("import: unrecognised image format (want qcow2 or tar)".into());
    }
    let total = io::copy(&mut whole, &mut io::sink()).map_err(io_err("import: read input"))?;
    eprintln!("discarded qcow2 image: {total} bytes");
    Ok(0)
}

pub(super) fn image_import(store: &Store, args: &[String], discard: bool) -> CmdResult {
    let p = cli::parse(args, &[val("type")])?;
    let Some(name) = p.positionals.first().cloned() else {
        return Err("requires at least 1 arg(s), only received 0".into());
    };
    let mut input = open_input(p.positionals.get(1).map(String::as_str))?;
    if discard {
        return discard_image(&mut *input);
    }
    let mut hasher = Sha256::new();
    let mut head = Vec::with_capacity(512);
    let mut total: u64 = 0;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("import: read input: {e}")),
        };
        if head.len() < 512 {
            let take = (512 - head.len()).min(n);
            head.extend_from_slice(&buf[..take]);
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    if total == 0 {
        return Err("import: empty input".into());
    }
    let kind = if head.starts_with(b"QFI\xfb") {
        "cloudimg"
    } else if head.len() >= 262 && &head[257..262] == b"ustar" {
        "oci"
    } else {
        return Err("import: unrecognised image format (want qcow2 or tar)".into());
    };
    let hex: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let img = Image {
        id: format!("sha256:{hex}"),
        name,
        kind: kind.into(),
        size: total,
        created_at: Some(now_rfc3339()),
    };
    let _guard = store.lock().map_err(io_err("lock"))?;
    // Re-importing a name replaces the older record.
    for old in store
        .load_images()
        .into_iter()
        .filter(|i| i.name == img.name)
    {
        let _ = fs::remove_file(
            store
                .images_dir()
                .join(format!("{}.json", old.id.trim_start_matches("sha256:"))),
        );
    }
    store.save_image(&img).map_err(io_err("save image"))?;
    Ok(0)
}

pub(super) fn image_list(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val_s("output", 'o'), val("format")])?;
    let imgs = store.load_images();
    if p.get("output") == Some("json") || p.get("format") == Some("json") {
        return print_json(&imgs);
    }
    if imgs.is_empty() {
        println!("No images found.");
    }
    for i in imgs {
        println!("{:<72} {:<9} {}", i.id, i.kind, i.name);
    }
    Ok(0)
}

pub(super) fn image_rm(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[flag_s("force", 'f')])?;
    let _guard = store.lock().map_err(io_err("lock"))?;
    for r in &p.positionals {
        let img = store
            .resolve_image(r)
            .ok_or_else(|| format!("image \"{r}\": not found in any backend"))?;
        let _ = fs::remove_file(
            store
                .images_dir()
                .join(format!("{}.json", img.id.trim_start_matches("sha256:"))),
        );
    }
    Ok(0)
}
