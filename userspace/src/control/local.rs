//! The local workloads file (`--workloads FILE`).
