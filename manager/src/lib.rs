//! gpu-mps-manager library.
