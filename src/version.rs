//! Build metadata: version, git revision and build time baked in by the build script.
//! Nothing here reads the environment at run time.
