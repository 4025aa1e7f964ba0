//! The daemon's own process families (`process_*`, as every Prometheus client exports them) and
//! `vk_cocoon_build_info`, read from `/proc/self` at scrape time; never forks.

use std::fmt::Write as _;

use super::families::{escape_label, TextSource, PREFIX};

/// Writes the `process_*` families and the build info.
pub struct ProcessCollector;

/// The figures of one read of `/proc/self`; None where the file could not be read.
#[derive(Debug, Default, PartialEq)]
struct ProcessFigures {
    cpu_seconds: Option<f64>,
    resident_bytes: Option<u64>,
    virtual_bytes: Option<u64>,
    threads: Option<i64>,
    start_time_seconds: Option<f64>,
    open_fds: Option<usize>,
    max_fds: Option<u64>,
}

fn read_self() -> ProcessFigures {
    let mut f = ProcessFigures::default();
    let Ok(me) = procfs::process::Process::myself() else {
        return f;
    };
    let ticks = procfs::ticks_per_second().max(1) as f64;
    if let Ok(stat) = me.stat() {
        f.cpu_seconds = Some((stat.utime + stat.stime) as f64 / ticks);
        f.resident_bytes = Some(stat.rss.saturating_mul(procfs::page_size()));
        f.virtual_bytes = Some(stat.vsize);
        f.threads = Some(stat.num_threads);
        f.start_time_seconds = procfs::boot_time_secs()
            .ok()
            .map(|boot| boot as f64 + stat.starttime as f64 / ticks);
    }
    f.open_fds = me.fd_count().ok();
    f.max_fds = me
        .limits()
        .ok()
        .and_then(|l| match l.max_open_files.soft_limit {
            procfs::process::LimitValue::Value(v) => Some(v),
            procfs::process::LimitValue::Unlimited => None,
        });
    f
}

/// (name, help, type, value)
fn families(f: &ProcessFigures) -> [(&'static str, &'static str, &'static str, Option<f64>); 7] {
    [
        (
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            "counter",
            f.cpu_seconds,
        ),
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            "gauge",
            f.resident_bytes.map(|v| v as f64),
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            "gauge",
            f.virtual_bytes.map(|v| v as f64),
        ),
        (
            "process_threads",
            "Number of OS threads in the process.",
            "gauge",
            f.threads.map(|v| v as f64),
        ),
        (
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            "gauge",
            f.start_time_seconds,
        ),
        (
            "process_open_fds",
            "Number of open file descriptors.",
            "gauge",
            f.open_fds.map(|v| v as f64),
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors.",
            "gauge",
            f.max_fds.map(|v| v as f64),
        ),
    ]
}

impl TextSource for ProcessCollector {
    fn write_text(&self, out: &mut String) {
        for (name, help, kind, value) in families(&read_self()) {
            if let Some(v) = value {
                let _ = write!(
                    out,
                    "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
                );
            }
        }
        let name = format!("{PREFIX}build_info");
        let _ = write!(
            out,
            "# HELP {name} The running build: version and git revision (always 1).\n\
             # TYPE {name} gauge\n{name}{{revision=\""
        );
        escape_label(crate::version::GIT_REVISION, out);
        out.push_str("\",version=\"");
        escape_label(crate::version::VERSION, out);
        out.push_str("\"} 1\n");
    }

    fn family_names(&self) -> Vec<String> {
        let mut names: Vec<String> = families(&ProcessFigures::default())
            .iter()
            .map(|(n, ..)| n.to_string())
            .collect();
        names.push(format!("{PREFIX}build_info"));
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_daemons_own_figures_and_build() {
        let scrape = || {
            let mut text = String::new();
            ProcessCollector.write_text(&mut text);
            text
        };
        let value_in = |text: &str, name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
        };
        let text = scrape();
        let value = |name: &str| value_in(&text, name);
        assert!(value("process_resident_memory_bytes") > 1e6);
        assert!(value("process_threads") >= 1.0);
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_max_fds") >= value("process_open_fds"));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = value("process_start_time_seconds");
        assert!(
            started <= now + 1.0 && started > now - 86_400.0,
            "{started}"
        );
        // Burn a little CPU: the counter moves.
        let before = value("process_cpu_seconds_total");
        let mut x = 0u64;
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_millis(300) {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        std::hint::black_box(x);
        let again = scrape();
        assert!(value_in(&again, "process_cpu_seconds_total") > before);
        assert!(text.contains(&format!(
            "vk_cocoon_build_info{{revision=\"{}\",version=\"{}\"}} 1",
            crate::version::GIT_REVISION,
            crate::version::VERSION
        )));
    }
}
