//! Library half of the eBPF crate: empty. It exists so that `userspace` can list
//! this crate as a build-dependency (rebuilding the agent when a program
//! changes); the programs themselves are the `shunt-ebpf` binary.
#![no_std]
