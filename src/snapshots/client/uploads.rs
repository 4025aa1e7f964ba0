//! Uploads of the registry client: blobs (whole or streamed in PATCH pieces), manifests and
//! manifest deletes, each retried as a unit on temporary failures.

use std::io::Read;
use std::sync::Mutex;

use crate::snapshots::reference::{strip_port, Reference};
use crate::snapshots::TransferError;

use super::session::SessionState;
use super::*;
use crate::http_client::{checked, request, CallError};
use ureq::SendBody;

impl RegistryClient {
    /// Uploads a blob unless present: HEAD, POST, PATCH (whole body), PUT ?digest=, retried
    /// as a unit on transient failures. Body must be re-readable (bytes or a file).
    pub fn put_blob(
        &self,
        repository: &str,
        digest: &str,
        body: Body<'_>,
    ) -> Result<(), TransferError> {
        let key = (repository.to_string(), digest.to_string());
        if lock(&self.uploaded).contains(&key) {
            return Ok(());
        }
        let sess = self.session(&self.base.host, repository, "push,pull");
        let what = format!("upload blob {}/{repository}@{digest}", sess.host);
        let mut attempt = 0;
        loop {
            match self.upload_once(&sess, repository, digest, body) {
                Ok(()) => {
                    lock(&self.uploaded).insert(key);
                    return Ok(());
                }
                Err(f) if upload_failure_is_temporary(&f) && attempt < self.retry.delays.len() => {
                    log::info!("{what}: attempt {} failed, retrying", attempt + 1);
                    if let HttpFailure::Status(_, r) = f {
                        drop(r);
                    }
                    self.retry.sleep(attempt);
                    attempt += 1;
                }
                Err(f) => return Err(f.into_error(&what)),
            }
        }
    }

    fn upload_once(
        &self,
        sess: &Session,
        repository: &str,
        digest: &str,
        body: Body<'_>,
    ) -> Result<(), HttpFailure> {
        let head_url = self
            .url(&sess.host, &format!("/v2/{repository}/blobs/{digest}"))
            .map_err(HttpFailure::Auth)?;
        match self.exchange(sess, "HEAD", &head_url, &[], Body::Empty) {
            Ok(_) => return Ok(()),
            Err(HttpFailure::Status(404, _)) => {}
            Err(f) => return Err(f),
        }
        let post_url = self
            .url(&sess.host, &format!("/v2/{repository}/blobs/uploads/"))
            .map_err(HttpFailure::Auth)?;
        let resp = self.exchange(
            sess,
            "POST",
            &post_url,
            &[("Content-Type", "application/json")],
            Body::Empty,
        )?;
        if resp.status().as_u16() == 201 {
            return Ok(());
        }
        let loc = self.resolve_location(&post_url, header(&resp, "location"))?;
        let len = body.len().to_string();
        let resp = self.exchange(
            sess,
            "PATCH",
            &loc,
            &[
                ("Content-Type", "application/octet-stream"),
                ("Content-Length", &len),
            ],
            body,
        )?;
        let loc = self.resolve_location(&loc, header(&resp, "location"))?;
        let sep = if loc.contains('?') { '&' } else { '?' };
        let put_url = format!("{loc}{sep}digest={}", digest.replace(':', "%3A"));
        let resp = self.exchange(
            sess,
            "PUT",
            &put_url,
            &[("Content-Type", "application/octet-stream")],
            Body::Empty,
        )?;
        if resp.status().as_u16() != 201 {
            return Err(HttpFailure::Status(resp.status().as_u16(), Box::new(resp)));
        }
        Ok(())
    }

    /// Opens an upload session (POST) for a streamed blob; returns its Location.
    pub fn begin_upload(&self, repository: &str) -> Result<String, TransferError> {
        let sess = self.session(&self.base.host, repository, "push,pull");
        let what = format!("begin upload to {}/{repository}", sess.host);
        let post_url = self.url(&sess.host, &format!("/v2/{repository}/blobs/uploads/"))?;
        let resp = self
            .exchange(
                &sess,
                "POST",
                &post_url,
                &[("Content-Type", "application/json")],
                Body::Empty,
            )
            .map_err(|f| f.into_error(&what))?;
        if resp.status().as_u16() != 202 {
            return Err(TransferError::Registry(format!(
                "{what}: HTTP {} instead of 202",
                resp.status().as_u16()
            )));
        }
        self.resolve_location(&post_url, header(&resp, "location"))
            .map_err(|f| f.into_error(&what))
    }

    /// One PATCH carrying `len` bytes read from `body` (single use: sent once, no re-auth, no
    /// retry; callers fall back to [`RegistryClient::put_blob`]). Returns the next Location.
    pub fn patch_upload(
        &self,
        repository: &str,
        location: String,
        len: u64,
        body: &mut dyn Read,
    ) -> Result<String, TransferError> {
        let sess = self.session(&self.base.host, repository, "push,pull");
        let what = format!("stream upload to {}/{repository}", sess.host);
        let authz = if self.credentials_allowed(&location, &sess.host) {
            let mut st = lock(&sess.state);
            self.prepare(&sess, &mut st)?;
            self.auth_header(&sess, &mut st)?
        } else {
            None
        };
        let len = len.to_string();
        let mut headers = vec![
            ("Content-Type", "application/octet-stream"),
            ("Content-Length", len.as_str()),
        ];
        if let Some(a) = &authz {
            headers.push(("Authorization", a));
        }
        let sent = request("PATCH", &location, &headers)
            .body(SendBody::from_reader(body))
            .map_err(|e| TransferError::Transient(format!("{what}: {e}")))?;
        let resp = match checked(self.send(sent)) {
            Ok(r) => r,
            Err(CallError::Status(code, r)) => {
                return Err(HttpFailure::Status(code, r).into_error(&what))
            }
            Err(e) => return Err(TransferError::Transient(format!("{what}: {e}"))),
        };
        self.resolve_location(&location, header(&resp, "location"))
            .map_err(|f| f.into_error(&what))
    }

    /// Completes a streamed upload: PUT `<location>?digest=`; must answer 201.
    pub fn finish_upload(
        &self,
        repository: &str,
        location: String,
        digest: &str,
    ) -> Result<(), TransferError> {
        let sess = self.session(&self.base.host, repository, "push,pull");
        let what = format!("finish upload {}/{repository}@{digest}", sess.host);
        let sep = if location.contains('?') { '&' } else { '?' };
        let put_url = format!("{location}{sep}digest={}", digest.replace(':', "%3A"));
        let resp = self
            .exchange(
                &sess,
                "PUT",
                &put_url,
                &[("Content-Type", "application/octet-stream")],
                Body::Empty,
            )
            .map_err(|f| f.into_error(&what))?;
        if resp.status().as_u16() != 201 {
            return Err(TransferError::Registry(format!(
                "{what}: HTTP {} instead of 201",
                resp.status().as_u16()
            )));
        }
        lock(&self.uploaded).insert((repository.to_string(), digest.to_string()));
        Ok(())
    }

    fn resolve_location(
        &self,
        request_url: &str,
        loc: Option<&str>,
    ) -> Result<String, HttpFailure> {
        let loc = loc.filter(|l| !l.is_empty()).ok_or_else(|| {
            HttpFailure::Auth(TransferError::Registry(format!(
                "{request_url}: upload response lacks Location"
            )))
        })?;
        if loc.starts_with("http://") || loc.starts_with("https://") {
            let origin = |u: &str| u.splitn(4, '/').take(3).collect::<Vec<_>>().join("/");
            if origin(loc) != origin(request_url) {
                let host = loc.split('/').nth(2).unwrap_or("");
                let h = strip_port(host);
                let private = h.parse::<std::net::IpAddr>().map(|ip| match ip {
                    std::net::IpAddr::V4(v4) => {
                        v4.is_private() || v4.is_loopback() || v4.is_link_local()
                    }
                    std::net::IpAddr::V6(v6) => v6.is_loopback(),
                });
                if private.unwrap_or(false) {
                    return Err(HttpFailure::Auth(TransferError::Registry(format!("upload Location {loc} points at a private address on another host; refused"))));
                }
            }
            return Ok(loc.to_string());
        }
        let origin: String = request_url
            .splitn(4, '/')
            .take(3)
            .collect::<Vec<_>>()
            .join("/");
        if loc.starts_with('/') {
            Ok(format!("{origin}{loc}"))
        } else {
            let dir = request_url
                .rsplit_once('/')
                .map(|(d, _)| d)
                .unwrap_or(&origin);
            Ok(format!("{dir}/{loc}"))
        }
    }

    /// PUT a manifest under a tag (or digest), retried as a unit on temporary failures.
    pub fn put_manifest(
        &self,
        r: &Reference,
        body: &[u8],
        media_type: &str,
    ) -> Result<(), TransferError> {
        let sess = self.session(&r.host, &r.repository, "push,pull");
        let url = self.manifest_url(r)?;
        let what = format!("put manifest {r}");
        let mut attempt = 0;
        loop {
            match self.exchange(
                &sess,
                "PUT",
                &url,
                &[("Content-Type", media_type)],
                Body::Bytes(body),
            ) {
                Ok(_) => return Ok(()),
                Err(f) if upload_failure_is_temporary(&f) && attempt < self.retry.delays.len() => {
                    self.retry.sleep(attempt);
                    attempt += 1;
                }
                Err(f) => return Err(f.into_error(&what)),
            }
        }
    }

    /// DELETE a manifest by tag or digest with a fresh `push,pull,delete` session; 404 is
    /// success (ensure-absent). Registries that refuse tag deletes (distribution 2.x answers
    /// 400 DIGEST_INVALID, others 405) get the DELETE by the digest the tag resolves to; that
    /// removes every tag of the same manifest, which a tag delete on a registry supporting it
    /// would not, but is the only way such a registry forgets the tag.
    pub fn delete_manifest(&self, r: &Reference) -> Result<(), TransferError> {
        let Some(refused) = self.try_delete_manifest(r)? else {
            return Ok(());
        };
        if !matches!(r.target, crate::snapshots::reference::Target::Tag(_)) {
            return Err(refused);
        }
        let body = match self.get_manifest(r) {
            Ok((body, _)) => body,
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) => return Err(e),
        };
        let by_digest = Reference {
            target: crate::snapshots::reference::Target::Digest(sha256_digest(&body)),
            ..r.clone()
        };
        log::debug!("{}; deleting {by_digest} instead", refused.message());
        match self.try_delete_manifest(&by_digest)? {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// One manifest DELETE: `Ok(None)` when gone (or absent), `Ok(Some(e))` when the registry
    /// refused it (400, 405), `Err` for any other failure.
    fn try_delete_manifest(&self, r: &Reference) -> Result<Option<TransferError>, TransferError> {
        let sess = Session {
            host: r.host.clone(),
            repository: r.repository.clone(),
            actions: "push,pull,delete",
            state: Mutex::new(SessionState::default()),
        };
        let url = self.manifest_url(r)?;
        let what = format!("delete manifest {r}");
        match self.with_transport_retry(|| self.exchange(&sess, "DELETE", &url, &[], Body::Empty)) {
            Ok(_) | Err(HttpFailure::Status(404, _)) => Ok(None),
            Err(f @ HttpFailure::Status(400 | 405, _)) => Ok(Some(f.into_error(&what))),
            Err(f) => Err(f.into_error(&what)),
        }
    }
}

/// Temporary for a whole-sequence upload retry: network errors, or status in
/// {408, 429, 500, 502, 503, 504} without error codes, or only retryable codes.
fn upload_failure_is_temporary(f: &HttpFailure) -> bool {
    match f {
        HttpFailure::Transport(_) => true,
        HttpFailure::Auth(_) => false,
        HttpFailure::Status(code, _) => [408, 429, 500, 502, 503, 504].contains(code),
    }
}
