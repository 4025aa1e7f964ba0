//! Where one loop turn spent its time, by phase and kind of work, so that a turn that sets a
//! new longest-turn record can say in the log what made it long.
//!
//! A turn starts when the poll returns (the reactor's own reading of pipes and the waker
//! counts too) and ends after the after-turn bookkeeping. Parts are named by static strings:
//! recording one costs a clock read and a short linear search, nothing is formatted unless
//! the turn is logged.

use std::time::{Duration, Instant};

use super::timers::OwnTimer;
use super::Work;
use crate::provider::{Effect, Input};
use crate::reactor::Event;

/// One named share of a turn: how long it took in all and how many times it ran.
struct Part {
    what: &'static str,
    took: Duration,
    /// The loop thread's CPU time within `took` (the rest it was preempted or blocked).
    cpu: Duration,
    count: u32,
}

/// The parts of the current turn.
#[derive(Default)]
pub(super) struct TurnProfile {
    parts: Vec<Part>,
    /// The loop thread's CPU time when the turn started: a turn much longer than the CPU it
    /// used was preempted (a loaded host), not busy.
    cpu_at_start: Duration,
    /// The thread's CPU time at the last lap.
    cpu_at_lap: Duration,
    /// `/proc/thread-self/schedstat` of the loop thread (None where it cannot be read).
    schedstat: Option<std::fs::File>,
    /// Time the thread had waited on a run queue when the turn started (see `run_wait`).
    wait_at_start: Duration,
    /// CPU booked to short parts since the last reading of the CPU clock.
    booked_unread: Duration,
}

/// Parts shorter than this are booked their wall time as CPU (see `TurnProfile::lap`).
const SHORT_PART: Duration = Duration::from_micros(100);

impl TurnProfile {
    pub(super) fn clear(&mut self) {
        self.parts.clear();
        self.cpu_at_start = thread_cpu();
        self.cpu_at_lap = self.cpu_at_start;
        self.booked_unread = Duration::ZERO;
        self.wait_at_start = self.waited();
    }

    /// Opens the calling thread's scheduler statistics (call on the loop thread).
    pub(super) fn watch_this_thread(&mut self) {
        self.schedstat = std::fs::File::open("/proc/thread-self/schedstat").ok();
    }

    /// How long the loop thread waited on a run queue (runnable, not running: preempted by
    /// other threads) since `clear`. Wall time beyond CPU and this wait was spent blocked.
    pub(super) fn run_wait(&self) -> Duration {
        self.waited().saturating_sub(self.wait_at_start)
    }

    /// The thread's total run-queue wait so far (the second field of its schedstat).
    fn waited(&self) -> Duration {
        use std::os::unix::fs::FileExt;
        let Some(file) = self.schedstat.as_ref() else {
            return Duration::ZERO;
        };
        let mut buf = [0u8; 96];
        let n = file.read_at(&mut buf, 0).unwrap_or(0);
        std::str::from_utf8(&buf[..n])
            .ok()
            .and_then(|text| text.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map(Duration::from_nanos)
            .unwrap_or(Duration::ZERO)
    }

    /// The loop thread's CPU time spent since `clear`.
    pub(super) fn cpu(&self) -> Duration {
        thread_cpu().saturating_sub(self.cpu_at_start)
    }

    /// Books `took` and `cpu` to `what`.
    fn add(&mut self, what: &'static str, took: Duration, cpu: Duration) {
        match self.parts.iter_mut().find(|p| p.what == what) {
            Some(p) => {
                p.took += took;
                p.cpu += cpu;
                p.count += 1;
            }
            None => self.parts.push(Part {
                what,
                took,
                cpu,
                count: 1,
            }),
        }
    }

    /// Books the time since `since` (and the CPU since the last lap) to `what`; returns now.
    /// Reading the thread's CPU clock is a system call: a part shorter than `SHORT_PART` is
    /// booked its wall time as CPU instead (it cannot have used more), and the next reading
    /// takes that off, so the loop does not spend a few percent of its time measuring itself.
    pub(super) fn lap(&mut self, what: &'static str, since: Instant) -> Instant {
        let now = Instant::now();
        let took = now.saturating_duration_since(since);
        if took < SHORT_PART {
            self.booked_unread += took;
            self.add(what, took, took);
            return now;
        }
        let cpu = thread_cpu();
        let used = cpu
            .saturating_sub(self.cpu_at_lap)
            .saturating_sub(self.booked_unread);
        self.cpu_at_lap = cpu;
        self.booked_unread = Duration::ZERO;
        self.add(what, took, used);
        now
    }

    /// The parts, longest first, with their CPU time:
    /// `core:PodUpserted 12.1ms/11.8cpu x40, effect:Event 3.0ms/2.9cpu x120, ...`.
    pub(super) fn summary(&self) -> String {
        let mut parts: Vec<&Part> = self.parts.iter().collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.took));
        parts
            .iter()
            .map(|p| {
                format!(
                    "{} {:.1}ms/{:.1}cpu x{}",
                    p.what,
                    p.took.as_secs_f64() * 1000.0,
                    p.cpu.as_secs_f64() * 1000.0,
                    p.count
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// CPU time the calling thread has used.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// The kind of a provider input, for the profile.
pub(super) fn input_kind(input: &Input) -> &'static str {
    match input {
        Input::StartupListed { .. } => "core:StartupListed",
        Input::PodUpserted(_) => "core:PodUpserted",
        Input::PodDeleted(_) => "core:PodDeleted",
        Input::PodsRelisted(_) => "core:PodsRelisted",
        Input::CocoonDone { .. } => "core:CocoonDone",
        Input::LeaseLooked { .. } => "core:LeaseLooked",
        Input::KubeDone { .. } => "core:KubeDone",
        Input::TransferDone { .. } => "core:TransferDone",
        Input::HibernateEvidence { .. } => "core:HibernateEvidence",
        Input::SacDone { .. } => "core:SacDone",
        Input::OwnersRecorded { .. } => "core:OwnersRecorded",
        Input::PidChecked { .. } => "core:PidChecked",
        Input::VmPidRead { .. } => "core:VmPidRead",
        Input::SourceChecked { .. } => "core:SourceChecked",
        Input::VmEvent { .. } => "core:VmEvent",
        Input::Readiness { .. } => "core:Readiness",
        Input::Tick => "core:Tick",
        Input::EventStreamRestarted => "core:EventStreamRestarted",
    }
}

/// The kind of an effect, for the profile.
pub(super) fn effect_kind(effect: &Effect) -> &'static str {
    match effect {
        Effect::Cocoon { .. } => "effect:Cocoon",
        Effect::LookupLease { .. } => "effect:LookupLease",
        Effect::PatchPodStatus { .. } => "effect:PatchPodStatus",
        Effect::PatchPodAnnotations { .. } => "effect:PatchPodAnnotations",
        Effect::DeletePod { .. } => "effect:DeletePod",
        Effect::Event { .. } => "effect:Event",
        Effect::StartProbe { .. } => "effect:StartProbe",
        Effect::StopProbe { .. } => "effect:StopProbe",
        Effect::ReleaseLeases { .. } => "effect:ReleaseLeases",
        Effect::Metric(_) => "effect:Metric",
        Effect::CheckPid { .. } => "effect:CheckPid",
        Effect::ReadVmPid { .. } => "effect:ReadVmPid",
        _ => "effect:transfer",
    }
}

/// The kind of a reactor event, for the profile. `io` is the owner of the ready token as the
/// loop sees it (the probe engine and the event stream claim theirs before routing).
pub(super) fn event_kind(event: &Event<Work>, io: &'static str) -> &'static str {
    match event {
        Event::Io(_) => io,
        Event::Timer { key, .. } => match OwnTimer::from_key(*key) {
            Some(OwnTimer::Provider) => "timer:Provider",
            Some(OwnTimer::Watch) => "timer:Watch",
            Some(OwnTimer::Node) => "timer:Node",
            Some(OwnTimer::WatchRead) => "timer:WatchRead",
            Some(OwnTimer::Startup) => "timer:Startup",
            Some(OwnTimer::Watchdog) => "timer:Watchdog",
            Some(OwnTimer::Lane) => "timer:Lane",
            Some(OwnTimer::View) => "timer:View",
            Some(OwnTimer::Cocoon) => "timer:Cocoon",
            None => "timer:other",
        },
        Event::ChildOutput { .. } => "child-output",
        Event::ChildExit(_) => "child-exit",
        Event::Signal(_) => "signal",
        Event::Work(work) => match work {
            Work::Transfer { .. } => "work:Transfer",
            Work::Sac { .. } => "work:Sac",
            Work::Evidence { .. } => "work:Evidence",
            Work::SourceChecked { .. } => "work:SourceChecked",
            Work::LeasesReleased { .. } => "work:LeasesReleased",
            Work::KubeletAuth { .. } => "work:KubeletAuth",
            Work::PodWritten { .. } => "work:PodWritten",
            Work::EventWritten { .. } => "work:EventWritten",
            Work::NodeTicked(_) => "work:NodeTicked",
            Work::PodsListed { .. } => "work:PodsListed",
            Work::OwnersRecorded { .. } => "work:OwnersRecorded",
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_puts_the_longest_part_first_and_sums_repeats() {
        let mut p = TurnProfile::default();
        let ms = Duration::from_millis;
        p.add("effects", ms(3), ms(3));
        p.add("core:PodUpserted", ms(5), ms(1));
        p.add("core:PodUpserted", ms(7), ms(2));
        assert_eq!(
            p.summary(),
            "core:PodUpserted 12.0ms/3.0cpu x2, effects 3.0ms/3.0cpu x1"
        );
        p.clear();
        assert_eq!(p.summary(), "");
    }
}
