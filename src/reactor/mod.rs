//! The single mio poll loop: tokens, timers, child processes, signals and the worker-pool waker.
//! It owns no daemon state; it reports readiness and completions as events.
