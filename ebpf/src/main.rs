//! shunt's kernel side. Every program here acts only on pods that the agent
//! enrolled: a pod is enrolled when its network namespace's cookie is a key of
//! `SHUNT_ENROLLED`. Everything else passes untouched.
#![no_std]
#![no_main]

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
