//! Which host a rank runs on: ranks with the same host id share memory.

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
