//! Per-pod readiness probe schedules and their bookkeeping.
//! Decides when to probe and what a result means; the pinger and sockets live in network.
