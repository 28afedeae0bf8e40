//! The cluster model: what a message, a reduction and a copy cost.
//!
//! LogGP-style, per message of `m` bytes between ranks on different hosts:
//!
//! ```text
//! post:      the poster's CPU is busy  o                      (per message, per side)
//! ready      = max(send posted, receive posted + L)            (the verbs transport's
//!                                                              rendezvous: a receive,
//!                                                              posted as the executor's
//!                                                              windows and staging
//!                                                              slots allow, sends a
//!                                                              clear-to-send first)
//! tx_start   = max(ready, egress_free[src host])
//! egress_free[src host] = tx_start + m / B
//! rx_start   = max(tx_start + L, ingress_free[dst host])
//! ingress_free[dst host] = rx_start + m / B
//! done       = rx_start + m / B                                (seen by both ends)
//! ```
//!
//! Over TCP (`rendezvous` off) a message leaves as soon as it is sent
//! (`ready = send posted`) and waits in the receiver's socket buffer:
//! `done = max(rx_start + m / B, receive posted)`.
//!
//! `B` is the NIC's bandwidth divided by the network core's
//! oversubscription and `L` the link latency: a host's NIC sends one
//! message at a time and receives one at a time (full duplex), shared by all
//! its ranks, and a message cuts through (its last byte arrives `L` after it
//! left). Between ranks of one host the same equations hold with `B_intra`,
//! `L_intra` and ports per rank instead of per host (a shared-memory copy is
//! done by the ranks' own cores), and `ready = max(send posted, receive
//! posted)` (the flags are in memory both ends see). Reducing `m` received bytes into the output
//! keeps the rank's CPU busy `m / R`; copying them `m / B_intra`. A rank's
//! CPU does one thing at a time, so posting, reducing and copying delay what
//! the rank posts next, exactly where the executor would.
//!
//! Left out: congestion inside the network core beyond the oversubscription
//! factor, memory bandwidth shared by a host's ranks, and a port granted to a
//! message found later that starts earlier (ranks advance in event order, so
//! this shifts a message by at most one CPU action).

use std::fmt;

/// A link: bandwidth in bytes per second and latency in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub bandwidth: f64,
    pub latency: f64,
}

/// The machine being simulated.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    pub ranks: usize,
    pub ranks_per_host: usize,
    /// Each host's NIC.
    pub link: Link,
    /// Between ranks of one host.
    pub intra: Link,
    /// CPU time to post one message, seconds.
    pub overhead: f64,
    /// Bytes per second one core reduces.
    pub reduce_bandwidth: f64,
    /// How much less than the NICs' sum the network core carries (1: full bisection).
    pub oversubscription: f64,
    /// Whether data waits for the receive to be posted and its clear-to-send
    /// to cross the network (RDMA verbs) or leaves at once (TCP).
    pub rendezvous: bool,
}

impl Cluster {
    /// A RoCE cluster of `ranks` ranks, `ranks_per_host` per host: 400 Gb/s
    /// NICs at 2 us, shared memory at 200 Gb/s and 0.5 us, 0.5 us to post a
    /// message, 20 GB/s reductions, a non-blocking core.
    pub fn roce(ranks: usize, ranks_per_host: usize) -> Self {
        Cluster {
            ranks,
            ranks_per_host: ranks_per_host.max(1),
            link: Link {
                bandwidth: 400e9 / 8.0,
                latency: 2e-6,
            },
            intra: Link {
                bandwidth: 200e9 / 8.0,
                latency: 0.5e-6,
            },
            overhead: 0.5e-6,
            reduce_bandwidth: 20e9,
            oversubscription: 1.0,
            rendezvous: true,
        }
    }

    pub fn host_of(&self, rank: usize) -> usize {
        rank / self.ranks_per_host
    }

    pub fn hosts(&self) -> usize {
        self.ranks.div_ceil(self.ranks_per_host)
    }

    /// The ranks of each host, in rank order.
    pub fn host_ranks(&self) -> Vec<Vec<usize>> {
        (0..self.hosts())
            .map(|h| {
                (h * self.ranks_per_host..((h + 1) * self.ranks_per_host).min(self.ranks)).collect()
            })
            .collect()
    }

    /// Bandwidth between hosts, after the core's oversubscription.
    pub fn network_bandwidth(&self) -> f64 {
        self.link.bandwidth / self.oversubscription.max(1.0)
    }

    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("link bandwidth", self.link.bandwidth),
            ("intra-host bandwidth", self.intra.bandwidth),
            ("reduce bandwidth", self.reduce_bandwidth),
        ];
        if let Some((what, _)) = positive.iter().find(|(_, v)| !(*v > 0.0 && v.is_finite())) {
            return Err(format!("{what} must be positive"));
        }
        let times = [
            ("link latency", self.link.latency),
            ("intra-host latency", self.intra.latency),
            ("overhead", self.overhead),
        ];
        if let Some((what, _)) = times.iter().find(|(_, v)| !(*v >= 0.0 && v.is_finite())) {
            return Err(format!("{what} must be zero or positive"));
        }
        if self.ranks == 0 {
            return Err("a cluster needs at least one rank".into());
        }
        Ok(())
    }
}

impl fmt::Display for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "{} ranks, {} per host ({} hosts); {} NIC {:.0} Gb/s {:.2} us{}; intra-host {:.0} Gb/s {:.2} us; \
             {:.2} us per message posted; reductions {:.0} GB/s",
            self.ranks,
            self.ranks_per_host,
            self.hosts(),
            if self.rendezvous { "verbs" } else { "tcp" },
            self.link.bandwidth * 8e-9,
            self.link.latency * 1e6,
            match self.oversubscription {
                o if o > 1.0 => format!(", core oversubscribed {o}:1"),
                _ => String::new(),
            },
            self.intra.bandwidth * 8e-9,
            self.intra.latency * 1e6,
            self.overhead * 1e6,
            self.reduce_bandwidth * 1e-9,
        )
    }
}

/// When each port (a host's NIC side, or a rank's shared-memory side) is next free.
pub(super) struct Ports {
    egress: Vec<f64>,
    ingress: Vec<f64>,
}

impl Ports {
    pub fn new(n: usize) -> Self {
        Ports {
            egress: vec![0.0; n],
            ingress: vec![0.0; n],
        }
    }

    /// Reserves the ports for a message of `bytes` from port `src` to `dst`
    /// that may start at `ready`; when its last byte lands.
    pub fn carry(&mut self, src: usize, dst: usize, ready: f64, bytes: f64, link: Link) -> f64 {
        let wire = bytes / link.bandwidth;
        let tx = ready.max(self.egress[src]);
        self.egress[src] = tx + wire;
        let rx = (tx + link.latency).max(self.ingress[dst]);
        self.ingress[dst] = rx + wire;
        rx + wire
    }
}
