//! shunt's kernel side. Every program here acts only on enrolled pods: the
//! socket programs find the pod by its network namespace's cookie in
//! `SHUNT_ENROLLED`; the TC programs are loaded per pod with its slot baked
//! in. Everything else passes untouched.
#![no_std]
#![no_main]

mod connect;
mod dns;
mod fixture;
mod host_probe;
mod maps;
mod mesh_local;
mod mesh_service;
mod passthrough;
mod peername;
mod policy;
mod sockops;
mod sockopt;
mod splice;
mod tc_pod;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any path that could reach here; this only
    // satisfies the compiler.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
