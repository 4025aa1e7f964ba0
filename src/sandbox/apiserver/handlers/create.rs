//! The fake API server's create verb: kind checks, defaulting, time normalisation and the
//! validation a real API server would do for each kind.

use serde_json::{json, Value};

use super::super::meta::{self, ApiError};
use super::super::resources::ResourceDef;
use super::super::store::{self, metadata_mut};
use super::super::Shared;

pub(super) fn check_kind(def: &ResourceDef, body: &mut Value) -> Result<(), ApiError> {
    let want_av = def.api_version();
    let kind = body.get("kind").and_then(Value::as_str).unwrap_or("");
    let av = body.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if (!kind.is_empty() && kind != def.kind) || (!av.is_empty() && av != want_av) {
        return Err(ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): {kind} {av}",
            def.kind
        )));
    }
    body["kind"] = json!(def.kind);
    body["apiVersion"] = json!(want_av);
    Ok(())
}

/// Creates an object with the API server's defaulting and validation for its kind.
pub fn create_object(
    shared: &Shared,
    def: &'static ResourceDef,
    namespace: &str,
    mut body: Value,
) -> Result<Value, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    check_kind(def, &mut body)?;
    let body_ns = store::obj_namespace(&body).to_string();
    if def.namespaced && !body_ns.is_empty() && body_ns != namespace {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let md = metadata_mut(&mut body);
    md.remove("resourceVersion");
    if def.namespaced {
        md.insert("namespace".into(), json!(namespace));
    }
    match def.plural {
        "pods" => {
            let spec = body.get("spec").cloned().unwrap_or(json!({}));
            let mut spec = spec;
            for (k, v) in [
                ("restartPolicy", json!("Always")),
                ("terminationGracePeriodSeconds", json!(30)),
                ("dnsPolicy", json!("ClusterFirst")),
                ("schedulerName", json!("default-scheduler")),
            ] {
                if spec.get(k).is_none() {
                    spec[k] = v;
                }
            }
            body["spec"] = spec;
            // The pod create strategy discards any client-sent status.
            body["status"] = json!({"phase": "Pending", "qosClass": "BestEffort"});
        }
        "namespaces" => {
            body["status"] = json!({"phase": "Active"});
        }
        _ => {}
    }
    normalize_times(def, &mut body)?;
    validate(def, &body)?;
    shared.store.create(def, namespace, body)
}

/// MicroTime fields are stored with exactly six fractional digits, whatever the client sent.
pub(super) fn normalize_times(def: &ResourceDef, obj: &mut Value) -> Result<(), ApiError> {
    let fields: &[&str] = match def.plural {
        "leases" => &["/spec/renewTime", "/spec/acquireTime"],
        "events" => &["/eventTime"],
        _ => &[],
    };
    for f in fields {
        if let Some(v) = obj.pointer_mut(f) {
            if let Value::String(s) = v {
                let t = meta::parse_rfc3339(s).ok_or_else(|| {
                    ApiError::bad_request(format!("{f}: invalid MicroTime {s:?}"))
                })?;
                let micro = s
                    .split_once('.')
                    .map(|(_, frac)| frac.trim_end_matches('Z'))
                    .filter(|frac| frac.len() == 6 && frac.bytes().all(|b| b.is_ascii_digit()));
                if micro.is_none() {
                    *s = meta::rfc3339_micros(t);
                }
            } else if !v.is_null() {
                return Err(ApiError::bad_request(format!(
                    "{f}: MicroTime must be a string"
                )));
            }
        }
    }
    Ok(())
}

/// The validation a real API server applies that clients most often get wrong.
pub(super) fn validate(def: &ResourceDef, obj: &Value) -> Result<(), ApiError> {
    let name = store::obj_name(obj).to_string();
    if let Some(refs) = obj.pointer("/metadata/ownerReferences") {
        let refs = refs.as_array().ok_or_else(|| {
            ApiError::invalid(def.kind, &name, "metadata.ownerReferences: must be a list")
        })?;
        for r in refs {
            for field in ["apiVersion", "kind", "name", "uid"] {
                if r.get(field)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .is_empty()
                {
                    return Err(ApiError::invalid(
                        def.kind,
                        &name,
                        format!("metadata.ownerReferences.{field}: Invalid value: \"\": {field} must not be empty"),
                    ));
                }
            }
        }
    }
    match def.plural {
        "pods" => {
            let containers = obj.pointer("/spec/containers").and_then(Value::as_array);
            match containers {
                Some(cs) if !cs.is_empty() => {
                    for (i, c) in cs.iter().enumerate() {
                        for field in ["name", "image"] {
                            if c.get(field)
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .is_empty()
                            {
                                return Err(ApiError::invalid(
                                    "Pod",
                                    &name,
                                    format!("spec.containers[{i}].{field}: Required value"),
                                ));
                            }
                        }
                    }
                }
                _ => {
                    return Err(ApiError::invalid(
                        "Pod",
                        &name,
                        "spec.containers: Required value",
                    ))
                }
            }
        }
        "leases" => {
            if let Some(d) = obj.pointer("/spec/leaseDurationSeconds") {
                if d.as_i64().is_none_or(|d| d <= 0) {
                    return Err(ApiError::invalid(
                        "Lease",
                        &name,
                        "spec.leaseDurationSeconds: Invalid value: must be greater than 0",
                    ));
                }
            }
        }
        "events" => {
            let io_ns = obj
                .pointer("/involvedObject/namespace")
                .and_then(Value::as_str)
                .unwrap_or("");
            if !io_ns.is_empty() && io_ns != store::obj_namespace(obj) {
                return Err(ApiError::invalid(
                    "Event",
                    &name,
                    "involvedObject.namespace: Invalid value: does not match event.namespace",
                ));
            }
        }
        _ => {}
    }
    Ok(())
}
