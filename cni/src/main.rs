//! `shunt-cni`: the CNI plugin binary. See the library's `plugin` module.

use std::io::{Read as _, Write as _};

fn main() {
    let env: std::collections::BTreeMap<String, String> = std::env::vars().collect();
    let mut stdin = Vec::new();
    // VERSION has no stdin; an unreadable stdin is reported as a decoding
    // failure by `run`.
    let _ = std::io::stdin()
        .take(shunt_cni::wire::MAX_MESSAGE)
        .read_to_end(&mut stdin);
    let outcome = shunt_cni::plugin::run(&env, &stdin);
    if let Some(line) = &outcome.log {
        eprintln!("{line}");
    }
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(outcome.stdout.as_bytes());
    let _ = stdout.flush();
    std::process::exit(outcome.exit_code);
}
