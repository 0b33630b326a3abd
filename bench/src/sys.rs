//! What the kernel tells about cost: whole-machine CPU from `/proc/stat`, a
//! process's CPU and memory from `/proc/PID/{stat,status}`, kernel TCP memory
//! from `/proc/net/sockstat`; and CPU placement (`sched_setaffinity`).

use std::{fs, path::Path};

use serde::{Deserialize, Serialize};

/// The aggregate `cpu` line of `/proc/stat`, in clock ticks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuTimes {
    pub user: u64,
    pub nice: u64,
    pub system: u64,
    pub idle: u64,
    pub iowait: u64,
    pub irq: u64,
    pub softirq: u64,
    pub steal: u64,
}

impl CpuTimes {
    pub fn read() -> Option<CpuTimes> {
        parse_proc_stat(&fs::read_to_string("/proc/stat").ok()?)
    }

    /// Ticks spent doing work: user, nice, system, irq and softirq.
    pub fn busy(&self) -> u64 {
        self.user + self.nice + self.system + self.irq + self.softirq
    }

    pub fn total(&self) -> u64 {
        self.busy() + self.idle + self.iowait + self.steal
    }

    pub fn delta(&self, earlier: &CpuTimes) -> CpuTimes {
        CpuTimes {
            user: self.user.saturating_sub(earlier.user),
            nice: self.nice.saturating_sub(earlier.nice),
            system: self.system.saturating_sub(earlier.system),
            idle: self.idle.saturating_sub(earlier.idle),
            iowait: self.iowait.saturating_sub(earlier.iowait),
            irq: self.irq.saturating_sub(earlier.irq),
            softirq: self.softirq.saturating_sub(earlier.softirq),
            steal: self.steal.saturating_sub(earlier.steal),
        }
    }
}

pub fn parse_proc_stat(text: &str) -> Option<CpuTimes> {
    parse_cpu_line(text.lines().find(|l| l.starts_with("cpu "))?)
}

/// The sum of the `cpuN` lines of `/proc/stat` for the given CPUs.
pub fn parse_proc_stat_cpus(text: &str, cpus: &[usize]) -> Option<CpuTimes> {
    let mut sum = CpuTimes::default();
    let mut found = 0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("cpu") else {
            continue;
        };
        let Some(n) = rest
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        if cpus.contains(&n) {
            let t = parse_cpu_line(line)?;
            sum.user += t.user;
            sum.nice += t.nice;
            sum.system += t.system;
            sum.idle += t.idle;
            sum.iowait += t.iowait;
            sum.irq += t.irq;
            sum.softirq += t.softirq;
            sum.steal += t.steal;
            found += 1;
        }
    }
    (found > 0).then_some(sum)
}

fn parse_cpu_line(line: &str) -> Option<CpuTimes> {
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    Some(CpuTimes {
        user: *v.first()?,
        nice: *v.get(1)?,
        system: *v.get(2)?,
        idle: *v.get(3)?,
        iowait: v.get(4).copied().unwrap_or(0),
        irq: v.get(5).copied().unwrap_or(0),
        softirq: v.get(6).copied().unwrap_or(0),
        steal: v.get(7).copied().unwrap_or(0),
    })
}

/// Clock ticks per second (`USER_HZ`).
pub fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as u64 } else { 100 }
}

pub fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as u64 } else { 4096 }
}

pub fn cpu_count() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .max(online_cpus())
}

fn online_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 { n as usize } else { 1 }
}

/// `usage_usec` of a cgroup v2 dir's `cpu.stat` (every process that ever
/// ran in it, threads that exited included).
pub fn cgroup_usage_usec(dir: &Path) -> Option<u64> {
    let text = fs::read_to_string(dir.join("cpu.stat")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))?
        .trim()
        .parse()
        .ok()
}

/// PIDs of the per-CPU `ksoftirqd/N` kernel threads.
pub fn ksoftirqd_pids() -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        // Kernel threads start early: a bound on the scan.
        .filter(|&pid| pid < 4096)
        .filter(|pid| {
            fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.starts_with("ksoftirqd/"))
        })
        .collect()
}

/// utime + stime of a process (all its threads), in clock ticks.
pub fn process_cpu_ticks(pid: u32) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces): state is
    // field 3, utime 14, stime 15.
    let after = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Context switches of each thread of a process, by thread id: voluntary
/// (it slept: waited on a timer, a socket, a lock) plus nonvoluntary (it
/// was preempted), from `/proc/PID/task/TID/status`. Each is a time the
/// thread was switched out, so over an idle spell their sum is how often
/// the process woke up.
pub fn thread_context_switches(pid: u32) -> Vec<(u32, u64)> {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|tid| {
            let text = fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).ok()?;
            Some((tid, parse_context_switches(&text)?))
        })
        .collect()
}

/// `voluntary_ctxt_switches` + `nonvoluntary_ctxt_switches` of a
/// `/proc/.../status` text.
pub fn parse_context_switches(status: &str) -> Option<u64> {
    let field = |name: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))?
            .trim()
            .parse()
            .ok()
    };
    Some(field("voluntary_ctxt_switches:")? + field("nonvoluntary_ctxt_switches:")?)
}

/// (VmRSS, VmHWM) of a process in KiB.
pub fn process_memory_kib(pid: u32) -> Option<(u64, u64)> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Kernel TCP memory in pages (`TCP: ... mem N` of `/proc/net/sockstat`:
/// machine-wide, whatever netns reads it).
pub fn tcp_mem_pages() -> Option<u64> {
    parse_sockstat_tcp_mem(&fs::read_to_string("/proc/net/sockstat").ok()?)
}

pub fn parse_sockstat_tcp_mem(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("TCP:"))?;
    let mut fields = line.split_whitespace();
    while let Some(f) = fields.next() {
        if f == "mem" {
            return fields.next()?.parse().ok();
        }
    }
    None
}

/// Sets the CPU affinity of one thread (or process main thread) `tid`; 0 is
/// the calling thread.
pub fn set_affinity(tid: u32, cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        if libc::sched_setaffinity(
            tid as libc::pid_t,
            std::mem::size_of::<libc::cpu_set_t>(),
            &set,
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Sets the affinity of every thread of process `pid` (threads started later
/// inherit it from the thread that starts them).
pub fn set_affinity_all_threads(pid: u32, cpus: &[usize]) -> std::io::Result<()> {
    let dir = format!("/proc/{pid}/task");
    let mut done = 0;
    for entry in fs::read_dir(&dir)?.flatten() {
        if let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) {
            // A thread may exit between listing and setting.
            match set_affinity(tid, cpus) {
                Ok(()) => done += 1,
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => return Err(e),
            }
        }
    }
    if done == 0 {
        return Err(std::io::Error::other(format!("no thread of pid {pid}")));
    }
    Ok(())
}

/// One-line facts about the machine for the report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Machine {
    pub cpu_model: String,
    pub cpus: usize,
    pub memory_mib: u64,
    pub kernel: String,
    pub virtualization: String,
    pub commit: String,
    pub rustc: String,
    pub clock_ticks: u64,
}

impl Machine {
    pub fn probe(workspace: &Path) -> Machine {
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let memory_mib = fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.starts_with("MemTotal:"))?
                    .split_whitespace()
                    .nth(1)?
                    .parse::<u64>()
                    .ok()
            })
            .map(|kib| kib / 1024)
            .unwrap_or(0);
        let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let vm = command_line("systemd-detect-virt", &["--vm"], workspace)
            .filter(|v| v != "none")
            .unwrap_or_else(|| {
                if cpuinfo.contains(" hypervisor") {
                    "a".into()
                } else {
                    "no".into()
                }
            });
        let virtualization = match command_line("systemd-detect-virt", &["--container"], workspace)
            .filter(|c| c != "none")
        {
            Some(container) => format!("{vm} VM, in a {container} container"),
            None => format!("{vm} VM"),
        };
        let mut commit = command_line("git", &["rev-parse", "--short=12", "HEAD"], workspace)
            .unwrap_or_else(|| "unknown".into());
        if command_line("git", &["status", "--porcelain"], workspace).is_some_and(|s| !s.is_empty())
        {
            commit.push_str("+uncommitted");
        }
        let rustc = command_line("rustc", &["--version"], workspace).unwrap_or_default();
        Machine {
            cpu_model,
            cpus: cpu_count(),
            memory_mib,
            kernel,
            virtualization,
            commit,
            rustc,
            clock_ticks: clock_ticks(),
        }
    }
}

fn command_line(program: &str, args: &[&str], dir: &Path) -> Option<String> {
    let out = std::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_stat() {
        let t = parse_proc_stat("cpu  10 1 20 300 4 5 6 7 0 0\ncpu0 1 2 3 4\n").unwrap();
        assert_eq!(t.user, 10);
        assert_eq!(t.softirq, 6);
        assert_eq!(t.steal, 7);
        assert_eq!(t.busy(), 10 + 1 + 20 + 5 + 6);
        let text = "cpu  9 9 9 9\ncpu0 1 0 2 10 0 0 3 1\ncpu1 4 0 5 20 0 0 6 2\n";
        let one = parse_proc_stat_cpus(text, &[1]).unwrap();
        assert_eq!((one.user, one.softirq, one.steal), (4, 6, 2));
        let both = parse_proc_stat_cpus(text, &[0, 1]).unwrap();
        assert_eq!(both.system, 7);
        assert!(parse_proc_stat_cpus(text, &[5]).is_none());
    }

    #[test]
    fn parses_sockstat() {
        let text =
            "sockets: used 200\nTCP: inuse 5 orphan 0 tw 3 alloc 9 mem 42\nUDP: inuse 1 mem 2\n";
        assert_eq!(parse_sockstat_tcp_mem(text), Some(42));
    }

    #[test]
    fn parses_context_switches() {
        let text = "Name:\tshunt\nvoluntary_ctxt_switches:\t120\nnonvoluntary_ctxt_switches:\t7\n";
        assert_eq!(parse_context_switches(text), Some(127));
        assert_eq!(parse_context_switches("Name:\tshunt\n"), None);
    }
}
