//! Downloads of the registry client: manifests, blobs and ranged blob pieces, each read
//! through a reader that hashes and counts, so no unverified byte is trusted.

use std::io::{self, Read};
use std::sync::atomic::Ordering;

use sha2::{Digest as _, Sha256};

use crate::snapshots::reference::{hex_lower, Reference};
use crate::snapshots::TransferError;

use super::*;

impl RegistryClient {
    /// GET a manifest by tag or digest: body (≤ 100 MiB, digest-checked when fetched by
    /// digest) and Content-Type. 404 → [`TransferError::NotFound`].
    pub fn get_manifest(&self, r: &Reference) -> Result<(Vec<u8>, String), TransferError> {
        let sess = self.session(&r.host, &r.repository, "pull");
        let url = self.manifest_url(r)?;
        let what = format!("get manifest {r}");
        let resp = self
            .with_transport_retry(|| {
                self.exchange(
                    &sess,
                    "GET",
                    &url,
                    &[("Accept", MANIFEST_ACCEPT)],
                    Body::Empty,
                )
            })
            .map_err(|f| match f.into_error(&what) {
                TransferError::NotFound(_) => {
                    TransferError::NotFound(format!("manifest not found: {r}"))
                }
                e => e,
            })?;
        let ctype = header(&resp, "content-type").unwrap_or("").to_string();
        let mut body = Vec::new();
        resp.into_body()
            .into_reader()
            .take(MANIFEST_LIMIT + 1)
            .read_to_end(&mut body)
            .map_err(|e| TransferError::Transient(format!("{what}: reading body: {e}")))?;
        if body.len() as u64 > MANIFEST_LIMIT {
            return Err(TransferError::Format(format!(
                "{what}: manifest larger than {MANIFEST_LIMIT} bytes"
            )));
        }
        if let crate::snapshots::reference::Target::Digest(d) = &r.target {
            let got = sha256_digest(&body);
            if &got != d {
                return Err(TransferError::Integrity(format!(
                    "{what}: body digest {got} does not match"
                )));
            }
        }
        Ok((body, ctype))
    }

    /// HEAD a blob: present (200) or absent (404).
    pub fn has_blob(&self, repository: &str, digest: &str) -> Result<bool, TransferError> {
        let sess = self.session(&self.base.host, repository, "pull");
        self.has_blob_in(&sess, repository, digest)
    }

    fn has_blob_in(
        &self,
        sess: &Session,
        repository: &str,
        digest: &str,
    ) -> Result<bool, TransferError> {
        let url = self.url(&sess.host, &format!("/v2/{repository}/blobs/{digest}"))?;
        match self.with_transport_retry(|| self.exchange(sess, "HEAD", &url, &[], Body::Empty)) {
            Ok(_) => Ok(true),
            Err(HttpFailure::Status(404, _)) => Ok(false),
            Err(f) => Err(f.into_error(&format!("head blob {}/{repository}@{digest}", sess.host))),
        }
    }

    /// Opens a blob for reading; the reader hashes and counts while read and fails at EOF on
    /// a digest or length mismatch. Holds one of the [`MAX_DOWNLOADS`] slots until dropped.
    pub fn get_blob(
        &self,
        repository: &str,
        digest: &str,
        expected_size: u64,
    ) -> Result<BlobReader, TransferError> {
        let permit = self.acquire_download();
        let sess = self.session(&self.base.host, repository, "pull");
        let url = self.url(&sess.host, &format!("/v2/{repository}/blobs/{digest}"))?;
        let what = format!("get blob {}/{repository}@{digest}", sess.host);
        let resp = self
            .with_transport_retry(|| self.exchange(&sess, "GET", &url, &[], Body::Empty))
            .map_err(|f| f.into_error(&what))?;
        if let Some(len) = header(&resp, "content-length").and_then(|l| l.parse::<u64>().ok()) {
            if len != expected_size {
                return Err(TransferError::Integrity(format!(
                    "{what}: registry sends {len} bytes, descriptor says {expected_size}"
                )));
            }
        }
        Ok(BlobReader {
            inner: Box::new(resp.into_body().into_reader()),
            hasher: Sha256::new(),
            read: 0,
            expected_size,
            digest: digest.to_string(),
            what,
            done: false,
            hash: true,
            _permit: Some(permit),
        })
    }

    /// Reads bytes `offset .. offset + len` of a blob of `blob_size` bytes into `buf` with one
    /// `Range` GET (same session, auth and download gate as [`RegistryClient::get_blob`]).
    /// The whole exchange, body included, is retried under the transport retry policy, so a
    /// connection cut mid-piece costs one piece. [`RangeAnswer::NotPartial`] when the registry
    /// ignores the range (200 with the whole blob): nothing is read, the caller falls back to
    /// a single stream. The bytes are counted, not hashed; the caller hashes the whole blob.
    pub fn get_blob_range(
        &self,
        repository: &str,
        digest: &str,
        blob_size: u64,
        offset: u64,
        len: u64,
        buf: &mut Vec<u8>,
    ) -> Result<RangeAnswer, TransferError> {
        let end = offset
            .checked_add(len)
            .filter(|e| len > 0 && *e <= blob_size)
            .ok_or_else(|| {
                TransferError::Invalid(format!(
                    "range {offset}+{len} outside blob {digest} of {blob_size} bytes"
                ))
            })?;
        let permit = self.acquire_download();
        let sess = self.session(&self.base.host, repository, "pull");
        let url = self.url(&sess.host, &format!("/v2/{repository}/blobs/{digest}"))?;
        let what = format!(
            "get blob {}/{repository}@{digest} bytes {offset}-{}",
            sess.host,
            end - 1
        );
        let range = format!("bytes={offset}-{}", end - 1);
        let answer = self
            .with_transport_retry(|| {
                let resp = self.exchange(&sess, "GET", &url, &[("Range", &range)], Body::Empty)?;
                let answer = classify_range(
                    resp.status().as_u16(),
                    header(&resp, "content-range"),
                    header(&resp, "content-length"),
                    offset,
                    len,
                    blob_size,
                    &what,
                )
                .map_err(HttpFailure::Auth)?;
                if answer == RangeAnswer::NotPartial {
                    return Ok(answer);
                }
                let mut body = BlobReader {
                    inner: Box::new(resp.into_body().into_reader()),
                    hasher: Sha256::new(),
                    read: 0,
                    expected_size: len,
                    digest: digest.to_string(),
                    what: what.clone(),
                    done: false,
                    hash: false,
                    _permit: None,
                };
                buf.clear();
                buf.reserve(len as usize);
                match body.read_to_end(buf) {
                    Ok(_) => Ok(answer),
                    Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                        Err(HttpFailure::Auth(TransferError::Integrity(e.to_string())))
                    }
                    Err(e) => Err(HttpFailure::Transport(e.to_string())),
                }
            })
            .map_err(|f| f.into_error(&what))?;
        drop(permit);
        if answer == RangeAnswer::Partial {
            self.ranged.fetch_add(1, Ordering::Relaxed);
        }
        Ok(answer)
    }
}

/// How a registry answered a ranged blob GET.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeAnswer {
    /// 206 with exactly the requested range; the bytes were read.
    Partial,
    /// 200: the registry ignores ranges and sends the whole blob (not read).
    NotPartial,
}

/// Checks a ranged GET's status and headers against the request: 206 needs
/// `Content-Range: bytes <offset>-<offset+len-1>/<blob_size or *>` and, when present, a
/// `Content-Length` of `len`; 200 is [`RangeAnswer::NotPartial`]; anything else an error.
fn classify_range(
    status: u16,
    content_range: Option<&str>,
    content_length: Option<&str>,
    offset: u64,
    len: u64,
    blob_size: u64,
    what: &str,
) -> Result<RangeAnswer, TransferError> {
    match status {
        206 => {}
        200 => return Ok(RangeAnswer::NotPartial),
        other => {
            return Err(TransferError::Registry(format!(
                "{what}: HTTP {other} to a range request"
            )))
        }
    }
    let bad = |m: String| TransferError::Registry(format!("{what}: {m}"));
    let cr = content_range.ok_or_else(|| bad("206 without Content-Range".into()))?;
    let parsed = cr
        .trim()
        .strip_prefix("bytes ")
        .and_then(|r| r.split_once('/'))
        .and_then(|(span, total)| {
            let (a, b) = span.trim().split_once('-')?;
            Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?, total.trim()))
        });
    let Some((first, last, total)) = parsed else {
        return Err(bad(format!("unparsable Content-Range {cr:?}")));
    };
    if first != offset || last.checked_sub(first).map(|d| d + 1) != Some(len) {
        return Err(bad(format!(
            "Content-Range {cr:?} is not the requested bytes {offset}-{}",
            offset + len - 1
        )));
    }
    if total != "*" && total.parse::<u64>().ok() != Some(blob_size) {
        return Err(TransferError::Integrity(format!(
            "{what}: registry says the blob is {total} bytes, descriptor says {blob_size}"
        )));
    }
    if let Some(cl) = content_length {
        if cl.trim().parse::<u64>().ok() != Some(len) {
            return Err(bad(format!(
                "206 with Content-Length {cl}, range is {len} bytes"
            )));
        }
    }
    Ok(RangeAnswer::Partial)
}

/// `sha256:<hex>` of bytes.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex_lower(&Sha256::digest(data)))
}

/// A blob body being read: hashed and counted; mismatch is an `InvalidData` error at EOF
/// (or as soon as more bytes than declared arrive).
pub struct BlobReader {
    inner: Box<dyn Read + Send + Sync + 'static>,
    hasher: Sha256,
    read: u64,
    expected_size: u64,
    digest: String,
    what: String,
    done: bool,
    /// False after [`BlobReader::split`]: the [`BlobCheck`] hashes instead.
    hash: bool,
    /// The download slot, released with the reader (`None` when the caller holds it).
    _permit: Option<GatePermit>,
}

/// The digest half of a split [`BlobReader`]: fed the bytes wherever they are consumed, so
/// hashing runs on another thread than the network reads.
pub struct BlobCheck {
    hasher: Sha256,
    digest: String,
    what: String,
}

impl BlobCheck {
    /// A check of bytes fed in blob order against `digest` (`what` prefixes its error).
    pub fn new(digest: &str, what: &str) -> BlobCheck {
        BlobCheck {
            hasher: Sha256::new(),
            digest: digest.to_string(),
            what: what.to_string(),
        }
    }

    pub fn update(&mut self, data: &[u8]) {
        self.hasher.update(data);
    }

    /// `InvalidData` when the bytes fed do not hash to the descriptor's digest.
    pub fn finish(self) -> io::Result<()> {
        let got = format!("sha256:{}", hex_lower(&self.hasher.finalize()));
        if got != self.digest {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: digest mismatch: content hashes to {got}", self.what),
            ));
        }
        Ok(())
    }
}

impl BlobReader {
    /// Splits off the digest check: the reader keeps counting (length errors stay its own)
    /// but no longer hashes; every byte it returns must be fed to the check, then `finish`.
    pub fn split(mut self) -> (BlobReader, BlobCheck) {
        self.hash = false;
        let check = BlobCheck::new(&self.digest, &self.what);
        (self, check)
    }

    fn fail(&self, msg: String) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, format!("{}: {msg}", self.what))
    }
}

impl Read for BlobReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        // Ask for one byte beyond the declared size so an oversized body is noticed.
        let room = (self.expected_size - self.read + 1).min(buf.len() as u64) as usize;
        let n = self
            .inner
            .read(&mut buf[..room])
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", self.what)))?;
        if n == 0 {
            if self.read != self.expected_size {
                return Err(self.fail(format!(
                    "truncated: got {} of {} bytes",
                    self.read, self.expected_size
                )));
            }
            let got = format!("sha256:{}", hex_lower(&self.hasher.clone().finalize()));
            if self.hash && got != self.digest {
                return Err(self.fail(format!("digest mismatch: content hashes to {got}")));
            }
            self.done = true;
            return Ok(0);
        }
        self.read += n as u64;
        if self.read > self.expected_size {
            return Err(self.fail(format!("oversized: more than {} bytes", self.expected_size)));
        }
        if self.hash {
            self.hasher.update(&buf[..n]);
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classify(
        status: u16,
        cr: Option<&str>,
        cl: Option<&str>,
    ) -> Result<RangeAnswer, TransferError> {
        classify_range(status, cr, cl, 8, 4, 100, "w")
    }

    #[test]
    fn range_answers_are_classified() {
        let ok = Some("bytes 8-11/100");
        assert_eq!(classify(206, ok, Some("4")), Ok(RangeAnswer::Partial));
        assert_eq!(classify(206, ok, None), Ok(RangeAnswer::Partial));
        assert_eq!(
            classify(206, Some("bytes 8-11/*"), None),
            Ok(RangeAnswer::Partial)
        );
        // A registry that ignores Range answers 200 with the whole blob: fall back.
        assert_eq!(
            classify(200, None, Some("100")),
            Ok(RangeAnswer::NotPartial)
        );
        for (status, cr, cl) in [
            (206, None, None),
            (206, Some("bytes 0-3/100"), None),
            (206, Some("bytes 8-12/100"), None),
            (206, Some("bytes 8-11/100"), Some("5")),
            (206, Some("items 8-11/100"), None),
            (206, Some("bytes 8-x/100"), None),
            (206, Some("bytes 11-8/100"), None),
            (204, None, None),
        ] {
            let e = classify(status, cr, cl).expect_err("refused").to_string();
            assert!(e.starts_with("w: "), "{e}");
        }
        // The registry's idea of the blob size disagrees with the descriptor.
        let e = classify_range(206, Some("bytes 8-11/99"), None, 8, 4, 100, "w");
        assert!(matches!(e, Err(TransferError::Integrity(_))), "{e:?}");
    }
}
