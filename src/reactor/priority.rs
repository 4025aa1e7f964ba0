//! The loop thread's scheduling weight: the one thread that owns all state runs ahead of the
//! daemon's own helpers (kube lane workers, spawners) and the cocoon children they start.
//!
//! The loop is mostly idle (a few percent of a core), but it is latency-bound: every VM
//! event, probe answer, kubelet request and Lease tick passes through it. Under CFS a thread
//! gets a share of the CPU by weight among the runnable ones, so with 32 cocoon calls and a
//! dozen lane workers runnable at nice 0 a loop turn of 5 ms of CPU took 150-350 ms on a
//! loaded 2-core host. A lower nice value on this thread only (Linux keeps nice per thread)
//! lets it run as soon as it is runnable; threads and children started elsewhere keep the
//! default, and so do the VMs cocoon starts (cocoon is started by the spawner threads).

/// The loop thread's nice value: weight about 9x a default thread's.
pub const LOOP_NICE: i32 = -10;

/// Sets the calling thread's nice value (on Linux, `setpriority(PRIO_PROCESS, 0)` changes
/// the calling thread only). Needs CAP_SYS_NICE to go below 0; the caller logs a failure
/// and runs on at the default.
pub fn set_thread_nice(nice: i32) -> std::io::Result<()> {
    rustix::process::setpriority_process(None, nice).map_err(std::io::Error::from)
}

/// The calling thread's nice value.
pub fn thread_nice() -> std::io::Result<i32> {
    rustix::process::getpriority_process(None).map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nice_value_is_the_calling_threads_own() {
        // Raising the nice value (lowering the priority) needs no privilege.
        let before = thread_nice().expect("getpriority");
        let other = std::thread::spawn(move || {
            set_thread_nice(before + 1).expect("setpriority");
            thread_nice().expect("getpriority")
        })
        .join()
        .expect("thread");
        assert_eq!(other, before + 1);
        assert_eq!(thread_nice().expect("getpriority"), before);
    }
}
