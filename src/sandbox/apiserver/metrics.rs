//! metrics.k8s.io/v1beta1 (NodeMetrics, PodMetrics) computed, as metrics-server does, from each
//! node's kubelet `/metrics/resource`: memory is the working set, CPU the rate between two reads.
//!
//! The fake scrapes when asked rather than on a timer; the first request for a node reads twice,
//! one kubelet sample apart, so `kubectl top` answers on its first try.

use super::discovery::{METRICS_GROUP, METRICS_VERSION};
use super::http::{self, Request, Response};
use super::meta::{self, ApiError};
use super::select::Selector;
use super::{lock, proxy, resources, Shared};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The longest wait for the kubelet's next sample (it keeps one for about two seconds).
const KUBELET_SAMPLE_WAIT: Duration = Duration::from_secs(6);

/// A metrics.k8s.io request: nodes (optionally one) or pods (optionally one namespace / pod).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsTarget {
    Nodes(Option<String>),
    Pods(Option<String>, Option<String>),
}

pub fn metrics_target(path: &str) -> Option<MetricsTarget> {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match segs.as_slice() {
        ["apis", g, v, rest @ ..] if *g == METRICS_GROUP && *v == METRICS_VERSION => match rest {
            ["nodes"] => Some(MetricsTarget::Nodes(None)),
            ["nodes", n] => Some(MetricsTarget::Nodes(Some(n.to_string()))),
            ["pods"] => Some(MetricsTarget::Pods(None, None)),
            ["namespaces", ns, "pods"] => Some(MetricsTarget::Pods(Some(ns.to_string()), None)),
            ["namespaces", ns, "pods", p] => Some(MetricsTarget::Pods(
                Some(ns.to_string()),
                Some(p.to_string()),
            )),
            _ => None,
        },
        _ => None,
    }
}

/// One series of the exposition text: name, labels, value, timestamp in milliseconds.
#[derive(Debug, Clone, PartialEq)]
struct Series {
    name: String,
    labels: HashMap<String, String>,
    value: f64,
    ts_ms: u64,
}

/// The previous CPU counter of every series, keyed by node and series.
#[derive(Debug, Default)]
pub struct CpuSamples(HashMap<String, (f64, u64)>);

/// Parses the text exposition format as the kubelet writes it (labels without commas in values
/// are all this needs, but escaped quotes are honoured).
fn parse_exposition(text: &str) -> Vec<Series> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let Some(close) = line.rfind('}') else {
                    continue;
                };
                if close < open {
                    continue;
                }
                (
                    &line[..open],
                    parse_labels(&line[open + 1..close]),
                    &line[close + 1..],
                )
            }
            None => match line.split_once(' ') {
                Some((n, r)) => (n, HashMap::new(), r),
                None => continue,
            },
        };
        let mut fields = rest.split_whitespace();
        let Some(value) = fields.next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        let ts_ms = fields.next().and_then(|t| t.parse().ok()).unwrap_or(0);
        out.push(Series {
            name: name.to_string(),
            labels,
            value,
            ts_ms,
        });
    }
    out
}

fn parse_labels(s: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut chars = s.chars().peekable();
    loop {
        let key: String = chars
            .by_ref()
            .skip_while(|c| *c == ',' || c.is_whitespace())
            .take_while(|c| *c != '=')
            .collect();
        if key.is_empty() || chars.next() != Some('"') {
            break;
        }
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(other) => value.push(other),
                    None => break,
                },
                '"' => break,
                c => value.push(c),
            }
        }
        out.insert(key.trim().to_string(), value);
    }
    out
}

/// GET `path` from a kubelet; the body of a 200 answer.
fn kubelet_get(shared: &Shared, addr: SocketAddr, path: &str) -> Result<String, String> {
    let config = shared.kubelet_client()?;
    let mut tls = proxy::connect(config, addr).map_err(|e| format!("kubelet {addr}: {e}"))?;
    let head = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    tls.write_all(head.as_bytes())
        .and_then(|_| tls.flush())
        .map_err(|e| format!("kubelet {addr}: {e}"))?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        match tls.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            // A close without close_notify after the body is how many servers end.
            Err(_) if !raw.is_empty() => break,
            Err(e) => return Err(format!("kubelet {addr}: {e}")),
        }
        if raw.len() > 64 * 1024 * 1024 {
            return Err(format!("kubelet {addr}: answer too large"));
        }
    }
    let (status, body) = http::parse_response(&raw).map_err(|e| format!("kubelet {addr}: {e}"))?;
    if status != 200 {
        return Err(format!("kubelet {addr}: {path} answered {status}"));
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// What one node's kubelet reports, with CPU turned into nanocores over `window`.
struct NodeReading {
    node: String,
    timestamp: String,
    window_secs: f64,
    node_usage: Option<(u64, u64)>,
    /// (namespace, pod) -> container -> (nanocores, bytes)
    pods: HashMap<(String, String), HashMap<String, (u64, u64)>>,
}

fn scrape(shared: &Shared, node: &Value) -> Option<NodeReading> {
    let name = node["metadata"]["name"].as_str()?.to_string();
    let addr = proxy::kubelet_addr(node)?;
    let read = || match kubelet_get(shared, addr, "/metrics/resource") {
        Ok(text) => Some(parse_exposition(&text)),
        Err(e) => {
            log::debug!("fake apiserver: metrics of node {name}: {e}");
            None
        }
    };
    let mut series = read()?;
    let seen_before = {
        let samples = lock(&shared.cpu_samples);
        series
            .iter()
            .filter(|s| s.name.ends_with("_cpu_usage_seconds_total"))
            .all(|s| {
                samples
                    .0
                    .get(&key(&name, s))
                    .is_some_and(|(_, ts)| *ts < s.ts_ms)
            })
    };
    if !seen_before {
        remember(shared, &name, &series);
        // The kubelet refreshes its sample on its own schedule: wait for a newer one, bounded.
        let first_ts = series.first().map(|s| s.ts_ms).unwrap_or(0);
        let deadline = Instant::now() + KUBELET_SAMPLE_WAIT;
        loop {
            std::thread::sleep(Duration::from_millis(250));
            series = read()?;
            let newer = series.first().is_some_and(|s| s.ts_ms > first_ts);
            if newer || Instant::now() >= deadline {
                break;
            }
        }
    }
    let mut reading = NodeReading {
        node: name.clone(),
        timestamp: meta::now_rfc3339(),
        window_secs: 0.0,
        node_usage: None,
        pods: HashMap::new(),
    };
    let rates = rates(shared, &name, &series, &mut reading.window_secs);
    let memory_of = |metric: &str, labels: &HashMap<String, String>| {
        series
            .iter()
            .find(|s| s.name == metric && &s.labels == labels)
            .map(|s| s.value.max(0.0) as u64)
    };
    for s in &series {
        let Some(nanocores) = rates.get(&key(&name, s)).copied() else {
            continue;
        };
        match s.name.as_str() {
            "node_cpu_usage_seconds_total" => {
                let mem = memory_of("node_memory_working_set_bytes", &s.labels).unwrap_or(0);
                reading.node_usage = Some((nanocores, mem));
            }
            "container_cpu_usage_seconds_total" => {
                let mem = memory_of("container_memory_working_set_bytes", &s.labels).unwrap_or(0);
                let label = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
                reading
                    .pods
                    .entry((label("namespace"), label("pod")))
                    .or_default()
                    .insert(label("container"), (nanocores, mem));
            }
            _ => {}
        }
    }
    remember(shared, &name, &series);
    Some(reading)
}

fn key(node: &str, s: &Series) -> String {
    let mut labels: Vec<_> = s.labels.iter().collect();
    labels.sort();
    format!("{node}|{}|{labels:?}", s.name)
}

fn remember(shared: &Shared, node: &str, series: &[Series]) {
    let mut samples = lock(&shared.cpu_samples);
    for s in series
        .iter()
        .filter(|s| s.name.ends_with("_cpu_usage_seconds_total"))
    {
        samples.0.insert(key(node, s), (s.value, s.ts_ms));
    }
}

/// Nanocores per CPU series from the remembered previous counters; the longest window is kept.
fn rates(shared: &Shared, node: &str, series: &[Series], window: &mut f64) -> HashMap<String, u64> {
    let samples = lock(&shared.cpu_samples);
    let mut out = HashMap::new();
    for s in series
        .iter()
        .filter(|s| s.name.ends_with("_cpu_usage_seconds_total"))
    {
        let k = key(node, s);
        let Some((prev, prev_ts)) = samples.0.get(&k).copied() else {
            continue;
        };
        if s.ts_ms <= prev_ts {
            continue;
        }
        let secs = (s.ts_ms - prev_ts) as f64 / 1000.0;
        *window = window.max(secs);
        // A counter that went down belongs to a restarted VM: no rate this time.
        let used = (s.value - prev).max(0.0);
        out.insert(k, (used / secs * 1e9) as u64);
    }
    out
}

fn usage(nanocores: u64, bytes: u64) -> Value {
    json!({"cpu": format!("{nanocores}n"), "memory": bytes.to_string()})
}

fn window(secs: f64) -> String {
    format!("{:.3}s", secs.max(0.001))
}

/// Serves one metrics.k8s.io request.
pub fn handle(shared: &Shared, req: &Request, target: &MetricsTarget) -> Response {
    if req.method != "GET" {
        return error(&ApiError::method_not_allowed());
    }
    let api_version = format!("{METRICS_GROUP}/{METRICS_VERSION}");
    // `kubectl top pod -l app=x` selects on the objects' labels, as metrics-server does.
    let selector = match Selector::parse(None, req.query("labelSelector")) {
        Ok(s) => s,
        Err(e) => return error(&e),
    };
    let (nodes, _) = shared.store.list(resources::nodes(), None);
    let wanted_node = match target {
        MetricsTarget::Nodes(Some(n)) => Some(n.as_str()),
        _ => None,
    };
    let readings: Vec<NodeReading> = nodes
        .iter()
        .filter(|n| wanted_node.is_none_or(|w| n["metadata"]["name"] == w))
        .filter_map(|n| scrape(shared, n))
        .collect();
    match target {
        MetricsTarget::Nodes(one) => {
            let items: Vec<Value> = readings
                .iter()
                .filter(|r| {
                    let node = shared.store.get(resources::nodes(), "", &r.node);
                    node.is_some_and(|n| selector.matches(&n))
                })
                .filter_map(|r| {
                    let (cpu, mem) = r.node_usage?;
                    Some(json!({
                        "kind": "NodeMetrics",
                        "apiVersion": api_version,
                        "metadata": {"name": r.node, "creationTimestamp": r.timestamp},
                        "timestamp": r.timestamp,
                        "window": window(r.window_secs),
                        "usage": usage(cpu, mem),
                    }))
                })
                .collect();
            single_or_list(one.as_deref(), items, "NodeMetrics", "nodes", &api_version)
        }
        MetricsTarget::Pods(ns, one) => {
            let mut items = Vec::new();
            for r in &readings {
                for ((pod_ns, pod), containers) in &r.pods {
                    if ns.as_ref().is_some_and(|n| n != pod_ns)
                        || one.as_ref().is_some_and(|p| p != pod)
                    {
                        continue;
                    }
                    // Only pods the API knows (a VM outliving its pod is not a pod's usage).
                    let known = shared.store.get(resources::pods(), pod_ns, pod);
                    if !known.is_some_and(|p| selector.matches(&p)) {
                        continue;
                    }
                    let mut cs: Vec<Value> = containers
                        .iter()
                        .map(|(c, (cpu, mem))| json!({"name": c, "usage": usage(*cpu, *mem)}))
                        .collect();
                    cs.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
                    items.push(json!({
                        "kind": "PodMetrics",
                        "apiVersion": api_version,
                        "metadata": {"name": pod, "namespace": pod_ns,
                                     "creationTimestamp": r.timestamp},
                        "timestamp": r.timestamp,
                        "window": window(r.window_secs),
                        "containers": cs,
                    }));
                }
            }
            items.sort_by(|a, b| {
                let k = |v: &Value| {
                    (
                        v["metadata"]["namespace"]
                            .as_str()
                            .unwrap_or("")
                            .to_string(),
                        v["metadata"]["name"].as_str().unwrap_or("").to_string(),
                    )
                };
                k(a).cmp(&k(b))
            });
            single_or_list(one.as_deref(), items, "PodMetrics", "pods", &api_version)
        }
    }
}

fn single_or_list(
    one: Option<&str>,
    mut items: Vec<Value>,
    kind: &str,
    plural: &str,
    api_version: &str,
) -> Response {
    match one {
        Some(name) if items.is_empty() => error(&ApiError::not_found(METRICS_GROUP, plural, name)),
        Some(_) => Response::json(200, &items.swap_remove(0)),
        None => Response::json(
            200,
            &json!({"kind": format!("{kind}List"), "apiVersion": api_version,
                    "metadata": {}, "items": items}),
        ),
    }
}

fn error(e: &ApiError) -> Response {
    Response::json(e.code, &e.status())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_map_to_targets() {
        assert_eq!(
            metrics_target("/apis/metrics.k8s.io/v1beta1/namespaces/default/pods/p"),
            Some(MetricsTarget::Pods(
                Some("default".into()),
                Some("p".into())
            ))
        );
        assert_eq!(
            metrics_target("/apis/metrics.k8s.io/v1beta1/nodes"),
            Some(MetricsTarget::Nodes(None))
        );
        assert_eq!(metrics_target("/apis/metrics.k8s.io/v1beta1"), None);
        assert_eq!(metrics_target("/api/v1/nodes"), None);
    }

    #[test]
    fn exposition_lines_parse() {
        let text = "# HELP x y\nnode_cpu_usage_seconds_total 12.5 1700000000000\n\
            container_cpu_usage_seconds_total{container=\"agent\",namespace=\"default\",pod=\"a \\\"b\\\"\"} 3 1700000000001\n\
            broken{ 1\n";
        let s = parse_exposition(text);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].value, 12.5);
        assert_eq!(s[0].ts_ms, 1_700_000_000_000);
        assert_eq!(s[1].labels["pod"], "a \"b\"");
        assert_eq!(s[1].labels["container"], "agent");
        assert_eq!(s[1].labels["namespace"], "default");
    }
}
