//! The fake API server's list verb: selectors, pagination and its continue tokens.
//! Tables for kubectl come from `table`.

use base64::Engine;
use serde_json::{json, Value};
use std::sync::Arc;

use super::super::http::Request;
use super::super::meta::ApiError;
use super::super::resources::ResourceDef;
use super::super::select::Selector;
use super::super::store;
use super::super::table;
use super::super::Shared;
use super::{ok, Reply, ResourcePath};

pub(super) fn list_doc<'a>(
    def: &ResourceDef,
    items: impl Iterator<Item = &'a Value>,
    rv: u64,
    cont: Option<(String, usize)>,
) -> Value {
    // Like the real server, items in a list carry no kind/apiVersion.
    let items: Vec<Value> = items
        .map(|o| {
            let mut o = o.clone();
            if let Value::Object(m) = &mut o {
                m.remove("kind");
                m.remove("apiVersion");
            }
            o
        })
        .collect();
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if let Some((token, remaining)) = cont {
        metadata["continue"] = json!(token);
        metadata["remainingItemCount"] = json!(remaining);
    }
    json!({
        "kind": def.list_kind(),
        "apiVersion": def.api_version(),
        "metadata": metadata,
        "items": items,
    })
}

/// A continue token: the list's resourceVersion and the last key served.
pub(super) fn encode_continue(rv: u64, ns: &str, name: &str) -> String {
    let raw = json!({"rv": rv, "ns": ns, "name": name}).to_string();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
}

pub(super) fn decode_continue(token: &str) -> Result<(u64, String, String), ApiError> {
    let bad = || ApiError::bad_request("invalid continue token");
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| bad())?;
    let v: Value = serde_json::from_slice(&raw).map_err(|_| bad())?;
    let rv = v.get("rv").and_then(Value::as_u64).ok_or_else(bad)?;
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    Ok((rv, s("ns"), s("name")))
}

pub(super) fn list(shared: &Shared, req: &Request, rp: &ResourcePath) -> Result<Reply, ApiError> {
    let selector = Selector::parse(req.query("fieldSelector"), req.query("labelSelector"))?;
    if let Some(rv) = req.query("resourceVersion").filter(|v| !v.is_empty()) {
        rv.parse::<u64>()
            .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?;
    }
    let (items, current_rv) = shared.store.list(rp.def, rp.namespace.as_deref());
    let mut matching: Vec<Arc<Value>> = items.into_iter().filter(|o| selector.matches(o)).collect();
    let mut list_rv = current_rv;
    if let Some(token) = req.query("continue").filter(|t| !t.is_empty()) {
        let (rv, ns, name) = decode_continue(token)?;
        if rv < shared.store.compacted_rv() {
            return Err(ApiError::expired(
                "The provided continue parameter is too old to display a consistent list result. \
                 You can start a new list without the continue parameter.",
            ));
        }
        list_rv = rv;
        let after = (ns, name);
        matching.retain(|o| {
            (
                store::obj_namespace(o).to_string(),
                store::obj_name(o).to_string(),
            ) > after
        });
    }
    let limit = req
        .query("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let mut cont = None;
    if let Some(limit) = limit {
        if matching.len() > limit {
            let remaining = matching.len() - limit;
            matching.truncate(limit);
            if let Some(last) = matching.last() {
                cont = Some((
                    encode_continue(list_rv, store::obj_namespace(last), store::obj_name(last)),
                    remaining,
                ));
            }
        }
    }
    if table::wants_table(req.header("accept")) {
        let include = req.query("includeObject").unwrap_or("");
        let mut t = table::table(rp.def, &matching, list_rv, include);
        if let Some((token, remaining)) = cont {
            t["metadata"]["continue"] = json!(token);
            t["metadata"]["remainingItemCount"] = json!(remaining);
        }
        return ok(200, &t);
    }
    ok(
        200,
        &list_doc(rp.def, matching.iter().map(|a| a.as_ref()), list_rv, cont),
    )
}
