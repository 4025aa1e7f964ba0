//! The fake API server's delete verb: delete options, preconditions and pods' graceful
//! deletion (a deletionTimestamp first, the object gone later).

use serde_json::{json, Value};
use std::time::{Duration, SystemTime};

use super::super::http::Request;
use super::super::meta::{self, ApiError};
use super::super::resources::ResourceDef;
use super::super::store::{metadata_mut, Mutation};
use super::super::Shared;
use super::update::preconditions_hold;

/// DeleteOptions from the body and query (the body wins, as on the real server).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteOptions {
    pub grace_period_seconds: Option<i64>,
    pub uid: Option<String>,
    pub resource_version: Option<String>,
}

impl DeleteOptions {
    pub(super) fn from_request(req: &Request) -> Result<DeleteOptions, ApiError> {
        let mut opts = DeleteOptions::default();
        if let Some(g) = req.query("gracePeriodSeconds") {
            opts.grace_period_seconds =
                Some(g.parse().map_err(|_| {
                    ApiError::bad_request(format!("invalid gracePeriodSeconds {g:?}"))
                })?);
        }
        if !req.body.iter().all(u8::is_ascii_whitespace) {
            let body: Value = serde_json::from_slice(&req.body)
                .map_err(|e| ApiError::bad_request(format!("invalid DeleteOptions body: {e}")))?;
            if let Some(g) = body.get("gracePeriodSeconds").filter(|g| !g.is_null()) {
                opts.grace_period_seconds = Some(g.as_i64().ok_or_else(|| {
                    ApiError::bad_request("gracePeriodSeconds must be an integer")
                })?);
            }
            if let Some(p) = body.get("preconditions") {
                opts.uid = p.get("uid").and_then(Value::as_str).map(str::to_string);
                opts.resource_version = p
                    .get("resourceVersion")
                    .and_then(Value::as_str)
                    .map(str::to_string);
            }
        }
        Ok(opts)
    }
}

/// DELETE. A bound, non-terminal pod deleted with grace > 0 only gets deletionTimestamp and
/// deletionGracePeriodSeconds (its kubelet confirms with grace 0); everything else goes at once
/// unless finalizers hold it.
pub fn delete_object(
    shared: &Shared,
    def: &'static ResourceDef,
    namespace: &str,
    name: &str,
    opts: &DeleteOptions,
) -> Result<Value, ApiError> {
    let out = shared.store.mutate(def, namespace, name, |cur| {
        preconditions_hold(
            def,
            cur,
            opts.uid.as_deref(),
            opts.resource_version.as_deref(),
        )?;
        let has_finalizers = cur
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        let mut grace = 0;
        if def.plural == "pods" {
            let bound = !cur
                .pointer("/spec/nodeName")
                .and_then(Value::as_str)
                .unwrap_or("")
                .is_empty();
            let terminal = matches!(
                cur.pointer("/status/phase").and_then(Value::as_str),
                Some("Succeeded" | "Failed")
            );
            grace = opts.grace_period_seconds.unwrap_or_else(|| {
                cur.pointer("/spec/terminationGracePeriodSeconds")
                    .and_then(Value::as_i64)
                    .unwrap_or(30)
            });
            if !bound || terminal || grace < 0 {
                grace = 0;
            }
        }
        if grace == 0 && !has_finalizers {
            return Ok(Mutation::Remove(cur.clone()));
        }
        let existing = cur
            .pointer("/metadata/deletionGracePeriodSeconds")
            .and_then(Value::as_i64);
        let mut new = cur.clone();
        if existing.is_some_and(|e| e <= grace) {
            // Already terminating with a shorter or equal grace: nothing changes.
            return Ok(Mutation::Replace(new));
        }
        let at = SystemTime::now() + Duration::from_secs(grace as u64);
        let md = metadata_mut(&mut new);
        md.insert("deletionTimestamp".into(), json!(meta::rfc3339(at)));
        md.insert("deletionGracePeriodSeconds".into(), json!(grace));
        Ok(Mutation::Replace(new))
    })?;
    Ok(out)
}
