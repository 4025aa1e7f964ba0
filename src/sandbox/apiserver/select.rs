//! Field and label selectors for list and watch (`fieldSelector`, `labelSelector`).
//! Parsing and matching over JSON objects; no state.

use super::meta::ApiError;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
enum FieldReq {
    Eq(String, String),
    Ne(String, String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed `fieldSelector` + `labelSelector` pair; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    fields: Vec<FieldReq>,
    labels: Vec<LabelReq>,
}

impl Selector {
    pub fn parse(field: Option<&str>, label: Option<&str>) -> Result<Selector, ApiError> {
        let mut sel = Selector::default();
        for term in field.unwrap_or("").split(',').map(str::trim) {
            if term.is_empty() {
                continue;
            }
            let req = if let Some((k, v)) = term.split_once("!=") {
                FieldReq::Ne(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = term.split_once("==") {
                FieldReq::Eq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = term.split_once('=') {
                FieldReq::Eq(k.trim().into(), v.trim().into())
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid field selector term {term:?}"
                )));
            };
            sel.fields.push(req);
        }
        for term in split_label_terms(label.unwrap_or("")) {
            sel.labels.push(parse_label_term(&term)?);
        }
        Ok(sel)
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.fields.iter().all(|f| match f {
            FieldReq::Eq(path, want) => field_value(obj, path) == *want,
            FieldReq::Ne(path, want) => field_value(obj, path) != *want,
        }) && self.labels.iter().all(|l| label_matches(obj, l))
    }
}

/// The string value of a dotted field path ("spec.nodeName"); "" when absent.
pub fn field_value(obj: &Value, path: &str) -> String {
    let pointer = format!("/{}", path.replace('.', "/"));
    match obj.pointer(&pointer) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    }
}

fn split_label_terms(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect()
}

fn parse_set(s: &str) -> Result<Vec<String>, ApiError> {
    let inner = s
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| ApiError::bad_request(format!("invalid label set {s:?}")))?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

fn parse_label_term(term: &str) -> Result<LabelReq, ApiError> {
    if let Some(k) = term.strip_prefix('!') {
        return Ok(LabelReq::NotExists(k.trim().into()));
    }
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(LabelReq::Ne(k.trim().into(), v.trim().into()));
    }
    if let Some((k, v)) = term.split_once("==") {
        return Ok(LabelReq::Eq(k.trim().into(), v.trim().into()));
    }
    if let Some((k, v)) = term.split_once('=') {
        return Ok(LabelReq::Eq(k.trim().into(), v.trim().into()));
    }
    if let Some((k, set)) = term.split_once(" notin ") {
        return Ok(LabelReq::NotIn(k.trim().into(), parse_set(set)?));
    }
    if let Some((k, set)) = term.split_once(" in ") {
        return Ok(LabelReq::In(k.trim().into(), parse_set(set)?));
    }
    if term.contains(|c: char| c.is_whitespace() || "()<>".contains(c)) {
        return Err(ApiError::bad_request(format!(
            "invalid label selector term {term:?}"
        )));
    }
    Ok(LabelReq::Exists(term.into()))
}

fn label_matches(obj: &Value, req: &LabelReq) -> bool {
    let labels = obj.pointer("/metadata/labels");
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    match req {
        LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
        LabelReq::Ne(k, v) => get(k) != Some(v.as_str()),
        LabelReq::In(k, set) => get(k).is_some_and(|v| set.iter().any(|s| s == v)),
        LabelReq::NotIn(k, set) => get(k).is_none_or(|v| !set.iter().any(|s| s == v)),
        LabelReq::Exists(k) => get(k).is_some(),
        LabelReq::NotExists(k) => get(k).is_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn field_and_label_selectors() {
        let pod = json!({"metadata": {"name": "a", "labels": {"app": "web", "tier": "x"}},
                         "spec": {"nodeName": "n1", "hostNetwork": true}});
        let s = |f: &str, l: &str| Selector::parse(Some(f), Some(l)).unwrap();
        assert!(s("spec.nodeName=n1", "").matches(&pod));
        assert!(!s("spec.nodeName=n2", "").matches(&pod));
        assert!(s("spec.nodeName!=n2,metadata.name==a", "").matches(&pod));
        assert!(s("spec.hostNetwork=true", "").matches(&pod));
        assert!(s("", "app=web,tier in (x, y),!missing").matches(&pod));
        assert!(!s("", "app notin (web)").matches(&pod));
        assert!(s("", "tier").matches(&pod));
        assert!(Selector::parse(Some("nonsense"), None).is_err());
    }
}
