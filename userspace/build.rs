//! Builds the eBPF programs (`ebpf/`) for `bpfel-unknown-none` with the nightly
//! toolchain and bpf-linker (see shared/TOOLCHAIN.md); the agent embeds the
//! resulting object with `include_bytes_aligned!`.
//!
//! This is what `aya_build::build_ebpf` 0.2.0 does (same command, flags,
//! environment and target dir), except for the output: aya-build forwards
//! every line of the inner cargo as a `cargo:warning`, so every build of the
//! agent printed some thirty `warning: shunt@0.1.0:    Compiling …` lines
//! when nothing was wrong. Here the inner build's progress is kept and shown
//! only when it fails (or with `SHUNT_EBPF_VERBOSE=1`); the compiler's own
//! warnings about the programs are still passed on.
use std::{
    env,
    ffi::OsString,
    io::{BufReader, Read as _, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, anyhow, bail};
use cargo_metadata::{Artifact, CompilerMessage, Message, Target, diagnostic::DiagnosticLevel};

/// The toolchain `rustup run` builds the programs with.
const TOOLCHAIN: &str = "nightly";
/// Set to 1 (or true) to see the eBPF build's progress on success too.
const VERBOSE: &str = "SHUNT_EBPF_VERBOSE";
/// aya-build's switch to skip the eBPF build (kept: CI setups know it).
const SKIP: &str = "AYA_BUILD_SKIP";

fn main() {
    // Printed without a backtrace (RUST_BACKTRACE would add one to a
    // returned error): the inner build's own output says what went wrong.
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed={SKIP}");
    println!("cargo:rerun-if-env-changed={VERBOSE}");
    if is_set(SKIP) {
        println!("cargo:warning={SKIP} is set; skipping the eBPF build");
        return Ok(());
    }
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("reading the workspace metadata")?;
    let ebpf = packages
        .into_iter()
        .find(|p| p.name.as_str() == "shunt-ebpf")
        .ok_or_else(|| anyhow!("the shunt-ebpf package is not in the workspace"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("{} has no parent directory", ebpf.manifest_path))?;
    // The build-dependency on shunt-ebpf covers its library; this covers
    // its binaries (the programs).
    println!("cargo:rerun-if-changed={root_dir}");
    let hint = "building the eBPF programs (ebpf/) failed; if bpf-linker or the nightly's rust-src is missing, `cargo xtask setup` installs them";
    build(ebpf.name.as_str(), "", "").context(hint)?;
    // The agent's upgrade test loads an "older release" (the same programs
    // with an instruction-level difference and one map resized: see
    // ebpf/src/fixture.rs). Built only for test-seams agents: one more
    // compile of the eBPF crate (its `core` is shared), a few seconds.
    if env::var_os("CARGO_FEATURE_TEST_SEAMS").is_some() {
        build(
            ebpf.name.as_str(),
            "previous-release-fixture",
            "-previous-release-fixture",
        )
        .context(hint)?;
    }
    Ok(())
}

fn is_set(var: &str) -> bool {
    env::var_os(var).is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

fn env_var(name: &str) -> anyhow::Result<String> {
    env::var(name).map_err(|e| anyhow!("{name}: {e}"))
}

/// `rustup run nightly <program>`, or the program itself without rustup.
fn toolchain_command(program: &str) -> Command {
    match find_in_path("rustup") {
        Some(rustup) => {
            let mut cmd = Command::new(rustup);
            cmd.args(["run", TOOLCHAIN, program]);
            cmd
        }
        None => {
            println!(
                "cargo:warning=rustup not found in PATH; building the eBPF programs with the current toolchain"
            );
            Command::new(program)
        }
    }
}

fn find_in_path(program: &str) -> Option<PathBuf> {
    env::split_paths(&env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// Whether `-Z build-std` may be used: as aya-build decides it, from
/// RUSTC_BOOTSTRAP and the toolchain's channel.
fn use_build_std(package: &str) -> anyhow::Result<bool> {
    match env::var_os("RUSTC_BOOTSTRAP") {
        Some(v) if v == "1" || v == package => return Ok(true),
        Some(v) if v == "-1" => return Ok(false),
        _ => {}
    }
    let output = toolchain_command("rustc")
        .arg("-vV")
        .output()
        .context("running `rustc -vV` of the eBPF toolchain")?;
    if !output.status.success() {
        bail!(
            "`rustc -vV` of the {TOOLCHAIN} toolchain failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let release = text
        .lines()
        .find_map(|l| l.strip_prefix("release: "))
        .ok_or_else(|| anyhow!("`rustc -vV` printed no release line: {text}"))?;
    Ok(release.contains("-nightly"))
}

/// Builds `package`'s programs with `features` and copies each program
/// object to `OUT_DIR/<name><suffix>`.
fn build(package: &str, features: &str, suffix: &str) -> anyhow::Result<()> {
    let out_dir = PathBuf::from(env_var("OUT_DIR")?);
    let target = match env_var("CARGO_CFG_TARGET_ENDIAN")?.as_str() {
        "little" => "bpfel-unknown-none",
        "big" => "bpfeb-unknown-none",
        other => bail!("unsupported endianness {other}"),
    };
    let arch = env_var("CARGO_CFG_TARGET_ARCH")?;
    let bpf_target_arch = if arch.starts_with("riscv64") {
        "riscv64"
    } else {
        arch.as_str()
    };

    let mut cmd = toolchain_command("cargo");
    cmd.args([
        "build",
        "--package",
        package,
        "--bins",
        "--message-format=json",
        "--release",
        "--target",
        target,
    ]);
    if use_build_std(package)? {
        cmd.args(["-Z", "build-std=core"]);
    }
    cmd.args(["--features", features]);
    let mut rustflags = OsString::new();
    for part in [
        "--cfg=bpf_target_arch=\"",
        bpf_target_arch,
        "\"",
        "\x1f",
        "-Cdebuginfo=2",
        "\x1f",
        "-Clink-arg=--btf",
    ] {
        rustflags.push(part);
    }
    cmd.env("CARGO_ENCODED_RUSTFLAGS", rustflags);
    // The outer build's compiler would be the stable one.
    cmd.env_remove("RUSTC");
    cmd.env_remove("RUSTC_WORKSPACE_WRAPPER");
    // A target dir of its own: cargo would otherwise wait on its own lock.
    let target_dir = out_dir.join("aya-build").join("target").join(package);
    cmd.arg("--target-dir").arg(&target_dir);

    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let mut stderr = child
        .stderr
        .take()
        .ok_or_else(|| anyhow!("no stderr pipe"))?;
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("no stdout pipe"))?;
    let mut executables = Vec::new();
    // Everything the inner cargo said, in order; and what must be shown
    // even on success (the compiler's warnings about the programs).
    let mut transcript = Vec::new();
    let mut warnings = Vec::new();
    for message in Message::parse_stream(BufReader::new(stdout)) {
        match message.context("the eBPF build printed invalid JSON")? {
            Message::CompilerArtifact(Artifact {
                executable: Some(executable),
                target: Target { name, .. },
                ..
            }) => executables.push((name, executable.into_std_path_buf())),
            Message::CompilerMessage(CompilerMessage { message, .. }) => {
                let rendered = message.rendered.unwrap_or_default();
                if message.level == DiagnosticLevel::Warning {
                    warnings.extend(rendered.lines().map(str::to_owned));
                }
                transcript.extend(rendered.lines().map(str::to_owned));
            }
            Message::TextLine(line) => transcript.push(line),
            _ => {}
        }
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for {cmd:?}"))?;
    let progress = stderr.join().unwrap_or_default();
    if !status.success() {
        // Cargo shows a failed build script's stderr: the compiler's
        // messages, then the inner cargo's own lines.
        let mut stderr = std::io::stderr().lock();
        for line in transcript
            .iter()
            .map(String::as_str)
            .chain(progress.lines())
        {
            let _ = writeln!(stderr, "{line}");
        }
        bail!("{cmd:?} failed ({status}); its output is above");
    }
    let shown = if is_set(VERBOSE) {
        progress
            .lines()
            .map(str::to_owned)
            .chain(transcript)
            .collect()
    } else {
        warnings
    };
    for line in shown {
        println!("cargo:warning={line}");
    }
    for (name, binary) in executables {
        copy(&binary, &out_dir.join(format!("{name}{suffix}")))?;
    }
    Ok(())
}

fn copy(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::copy(from, to)
        .map(|_| ())
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))
}
