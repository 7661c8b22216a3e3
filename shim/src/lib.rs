//! gpu-mps-shim library: the pure spec rewrite and the runc argument parsing.
