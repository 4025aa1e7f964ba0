//! The fake API server's update and patch verbs: which fields a write may change, the
//! preconditions in the body, and the status / spec halves of the subresources.

use serde_json::{json, Value};

use super::super::meta::ApiError;
use super::super::patch::{self, PatchType};
use super::super::resources::ResourceDef;
use super::super::store::{self, metadata_mut, Mutation};
use super::super::Shared;
use super::create::{check_kind, normalize_times, validate};

/// Pod spec fields an update may change (the rest is immutable, as on a real server).
pub(super) fn pod_spec_mutable_view(spec: &Value) -> Value {
    let mut v = spec.clone();
    if let Value::Object(m) = &mut v {
        m.remove("activeDeadlineSeconds");
        m.remove("tolerations");
        m.remove("terminationGracePeriodSeconds");
        for list in ["containers", "initContainers"] {
            if let Some(Value::Array(cs)) = m.get_mut(list) {
                for c in cs {
                    if let Value::Object(cm) = c {
                        cm.remove("image");
                    }
                }
            }
        }
    }
    v
}

/// Applies the update rules of the main resource or the status subresource to `new`,
/// given the stored `cur`: system metadata is kept, the other half (status or spec) is reset.
pub(super) fn update_rules(
    def: &ResourceDef,
    sub: Option<&str>,
    cur: &Value,
    mut new: Value,
) -> Result<Mutation, ApiError> {
    if !new.is_object() {
        return Err(ApiError::bad_request("the object must be a JSON object"));
    }
    let name = store::obj_name(cur).to_string();
    let new_name = store::obj_name(&new);
    if !new_name.is_empty() && new_name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({new_name}) does not match the name on the URL ({name})"
        )));
    }
    let new_ns = store::obj_namespace(&new);
    if !new_ns.is_empty() && new_ns != store::obj_namespace(cur) {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    check_kind(def, &mut new)?;
    let cur_md = cur.get("metadata").cloned().unwrap_or(json!({}));
    let md = metadata_mut(&mut new);
    for k in [
        "name",
        "namespace",
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
    ] {
        match cur_md.get(k) {
            Some(v) => md.insert(k.into(), v.clone()),
            None => md.remove(k),
        };
    }
    let has_status = def.subresources.contains(&"status");
    if sub == Some("status") {
        match cur.get("spec") {
            Some(spec) => new["spec"] = spec.clone(),
            None => {
                if let Value::Object(m) = &mut new {
                    m.remove("spec");
                }
            }
        }
        if def.plural == "pods" {
            let owners = cur.pointer("/metadata/ownerReferences").cloned();
            let md = metadata_mut(&mut new);
            match owners {
                Some(o) => md.insert("ownerReferences".into(), o),
                None => md.remove("ownerReferences"),
            };
        }
    } else if has_status {
        match cur.get("status") {
            Some(status) => new["status"] = status.clone(),
            None => {
                if let Value::Object(m) = &mut new {
                    m.remove("status");
                }
            }
        }
        let old_spec = cur.get("spec").cloned().unwrap_or(Value::Null);
        let new_spec = new.get("spec").cloned().unwrap_or(Value::Null);
        if def.plural == "pods"
            && pod_spec_mutable_view(&old_spec) != pod_spec_mutable_view(&new_spec)
        {
            return Err(ApiError::invalid(
                "Pod",
                &name,
                "spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`, \
                 `spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` \
                 (only additions to existing tolerations), `spec.terminationGracePeriodSeconds`",
            ));
        }
        if old_spec != new_spec {
            let gen = cur
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            metadata_mut(&mut new).insert("generation".into(), json!(gen + 1));
        }
    }
    normalize_times(def, &mut new)?;
    validate(def, &new)?;
    // An object being deleted goes once its finalizers are gone (a bound pod additionally
    // waits for its kubelet's grace-0 delete).
    let deleting = new.pointer("/metadata/deletionTimestamp").is_some();
    let finalizers_empty = new
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty);
    let grace_done = def.plural != "pods"
        || new
            .pointer("/metadata/deletionGracePeriodSeconds")
            .and_then(Value::as_i64)
            == Some(0);
    if deleting && finalizers_empty && grace_done {
        return Ok(Mutation::Remove(new));
    }
    Ok(Mutation::Replace(new))
}

/// `metadata.uid` / `metadata.resourceVersion` in a write body are preconditions (empty: unset).
pub(super) fn check_preconditions(
    def: &ResourceDef,
    cur: &Value,
    body: &Value,
) -> Result<(), ApiError> {
    let set = |ptr: &str| {
        body.pointer(ptr)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    preconditions_hold(
        def,
        cur,
        set("/metadata/uid"),
        set("/metadata/resourceVersion"),
    )
}

/// A write's uid and resourceVersion preconditions against the stored object `cur`: a
/// mismatch is the API server's 409 (the uid one names both uids).
pub(super) fn preconditions_hold(
    def: &ResourceDef,
    cur: &Value,
    uid: Option<&str>,
    rv: Option<&str>,
) -> Result<(), ApiError> {
    let name = store::obj_name(cur);
    if let Some(uid) = uid.filter(|u| *u != store::obj_uid(cur)) {
        return Err(ApiError::conflict_uid(
            def.group,
            def.plural,
            name,
            uid,
            store::obj_uid(cur),
        ));
    }
    if rv.is_some_and(|rv| rv != store::obj_rv(cur)) {
        return Err(ApiError::conflict_modified(def.group, def.plural, name));
    }
    Ok(())
}

/// PUT: full replacement with optimistic concurrency on resourceVersion.
pub fn update_object(
    shared: &Shared,
    def: &'static ResourceDef,
    namespace: &str,
    name: &str,
    sub: Option<&str>,
    body: Value,
) -> Result<Value, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    let body_name = store::obj_name(&body);
    if !body_name.is_empty() && body_name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    if body
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        == Some("0")
    {
        // Kubernetes 1.35+ rejects the blind "0" version VK used to send.
        return Err(ApiError::invalid(
            def.kind,
            name,
            "metadata.resourceVersion: Invalid value: \"0\": must be specified for an update",
        ));
    }
    let out = shared.store.mutate(def, namespace, name, |cur| {
        check_preconditions(def, cur, &body)?;
        update_rules(def, sub, cur, body.clone())
    })?;
    Ok(out)
}

/// PATCH: applied to the stored object, then the same rules as an update.
#[allow(clippy::too_many_arguments)]
pub fn patch_object(
    shared: &Shared,
    def: &'static ResourceDef,
    namespace: &str,
    name: &str,
    sub: Option<&str>,
    kind: PatchType,
    body: &Value,
) -> Result<Value, ApiError> {
    let out = shared.store.mutate(def, namespace, name, |cur| {
        if kind != PatchType::Json {
            check_preconditions(def, cur, body)?;
        }
        let mut candidate = cur.clone();
        patch::apply(kind, &mut candidate, body)
            .map_err(|e| ApiError::new(422, "Invalid", format!("unable to apply patch: {e}")))?;
        if kind == PatchType::Json {
            check_preconditions(def, cur, &candidate)?;
        }
        update_rules(def, sub, cur, candidate)
    })?;
    Ok(out)
}
