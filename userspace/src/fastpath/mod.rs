//! The passthrough fast path (eBPF mode, builtin proxy, `--fast-path on`):
//! an enrolled pod's connect to a destination the proxy has no business
//! with — neither a mesh workload nor a service VIP — is not redirected to
//! the proxy but goes direct, decided at `connect()` by
//! `ebpf/src/passthrough.rs`; the connection is still counted and logged as
//! the proxy would have (Istio's TCP metrics, an access log line), from
//! events the kernel sends at establishment and close.
//!
//! Two tasks, both started by `app/`:
//!
//! - [`table::write_table`] — the one writer of the destination table and
//!   its valid switch (`SHUNT_FP_DESTS`, `SHUNT_FP_RANGES`,
//!   `SHUNT_FP_STATE`). It is fed by the
//!   store owner (`app::store::own_store`): after each applied cluster view
//!   it derives the set of destinations the proxy must see
//!   ([`table::destinations`]) and writes it, additions before removals,
//!   then turns the table on. A set too large for the table (addresses
//!   or ranges) or a failed write turns it off first (logged, counted):
//!   every connect goes back to the proxy.
//! - [`report::report_events`] — reads the kernel's events and turns them
//!   into what the proxy would have reported for a passthrough connection.
//!
//! The window: a new mesh workload is in the store before the table writer
//! adds it, so for that moment a connect to it from an enrolled pod goes
//! direct, in plaintext — where the destination's node still captures it
//! as inbound plaintext on 15006 and applies its policy
//! (`--inbound-plaintext`, authorization), as for any client outside the
//! mesh. The table is turned off when an agent starts and on again after
//! its first view, so a view an agent never saw is never trusted.

pub mod report;
pub mod table;
