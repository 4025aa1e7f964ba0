//! Guest-side helpers: the Windows SAC console dialer and the RDP help text.
//! Talks to a VM's serial console socket; never to the cluster.
