//! The pure lifecycle core: pod events, cocoon results, VM events and timers in; effects out.
//! It never reads a clock, a file or a socket; the daemon performs its effects.
