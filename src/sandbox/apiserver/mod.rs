//! A fake Kubernetes API server on loopback HTTPS: enough of the API for vk-cocoon and kubectl.
//! Test and sandbox infrastructure only; keeps objects in memory.
