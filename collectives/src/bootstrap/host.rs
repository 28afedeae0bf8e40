//! Which host a rank runs on (ranks with the same host id share memory)
//! and how many cores it gives the job.

use std::sync::OnceLock;

/// `(hostname, host id)`. The id joins the hostname, the kernel's boot id and
/// the network namespace, so containers or namespaces posing as separate hosts
/// on one machine count as separate hosts.
pub fn identity() -> (String, String) {
    let hostname = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let id = format!("{hostname}/{}/{netns}", boot.trim());
    (hostname, id)
}

/// The cores this job's ranks on this host may use (read once): the
/// job's cpuset (a container's, a Slurm allocation's), else every online
/// CPU, and never fewer than the process's own affinity.
pub fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| {
        let counted = cgroup_cpuset()
            .or_else(|| read_list("/sys/devices/system/cpu/online"))
            .filter(|n| *n > 0);
        let own = std::thread::available_parallelism().map_or(1, |c| c.get());
        counted.unwrap_or(own).max(own)
    })
}

/// The CPUs of our cgroup's cpuset (cgroup v2, else v1), if it has one.
fn cgroup_cpuset() -> Option<usize> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    groups.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        match controllers {
            "" => read_list(&format!("/sys/fs/cgroup/{path}/cpuset.cpus.effective")),
            c if c.split(',').any(|c| c == "cpuset") => read_list(&format!(
                "/sys/fs/cgroup/cpuset/{path}/cpuset.effective_cpus"
            )),
            _ => None,
        }
    })
}

/// The number of CPUs in a kernel CPU list file ("0-3,8,10-11").
fn read_list(path: &str) -> Option<usize> {
    count_list(std::fs::read_to_string(path).ok()?.trim())
}

fn count_list(list: &str) -> Option<usize> {
    if list.is_empty() {
        return None;
    }
    list.split(',').try_fold(0, |n, range| {
        let (a, b) = range.split_once('-').unwrap_or((range, range));
        let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        Some(n + b.checked_sub(a)? + 1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_are_counted() {
        assert_eq!(count_list("0-1"), Some(2));
        assert_eq!(count_list("0-3,8,10-11"), Some(7));
        assert_eq!(count_list("5"), Some(1));
        assert_eq!(count_list(""), None);
        assert_eq!(count_list("3-1"), None);
        assert!(cores() >= 1);
    }
}
