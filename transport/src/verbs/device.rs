//! Choosing the RDMA device, port and GID: the active port whose RoCE v2
//! GID holds the IPv4-mapped address of the interface the bootstrap uses,
//! as NCCL does, else the first active port. `COLL_IB_HCA` (`rxe0` or
//! `rxe0:1`) and `COLL_IB_GID_INDEX` override, like NCCL_IB_HCA and
//! NCCL_IB_GID_INDEX.

use std::net::IpAddr;
use std::sync::Arc;

use sideway::ibverbs::address::Gid;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};

use crate::{Error, Result};

/// Where this rank's queue pairs live.
pub(crate) struct Port {
    pub context: Arc<DeviceContext>,
    pub device: String,
    pub port: u8,
    pub gid: Gid,
    pub gid_index: u32,
    pub mtu: Mtu,
    /// The port's longest message (`max_msg_sz`; 0 where not reported).
    pub max_msg: u32,
}

/// RoCE v2 in `ibv_query_gid_type`'s numbering.
const ROCE_V2: u32 = 1;

/// Opens the device and finds the port and GID to use for `ip`.
pub(crate) fn open(ip: IpAddr) -> Result<Port> {
    let no_device = |why: String| {
        Error::Invalid(format!(
            "no usable RDMA device: {why}; choose another transport (--transport tcp, or COLL_TRANSPORT=tcp)"
        ))
    };
    let list = match DeviceList::new() {
        Ok(list) => list,
        // A kernel without RDMA answers ENOSYS: that is "no devices".
        Err(e) => return Err(no_device(format!("listing devices failed ({e})"))),
    };
    let (want_dev, want_port) = match std::env::var("COLL_IB_HCA") {
        Ok(v) => match v.split_once(':') {
            Some((d, p)) => (Some(d.to_string()), p.parse::<u8>().ok()),
            None => (Some(v), None),
        },
        Err(_) => (None, None),
    };
    // A port whose GID holds `ip` wins; else the first usable port.
    let mut fallback = None;
    for dev in list.iter() {
        if want_dev.as_ref().is_some_and(|w| *w != dev.name()) {
            continue;
        }
        let Ok(context) = dev.open() else { continue };
        let Ok(attr) = context.query_device() else {
            continue;
        };
        for port in 1..=attr.phys_port_cnt() {
            if want_port.is_some_and(|w| w != port) {
                continue;
            }
            let Ok(pattr) = context.query_port(port) else {
                continue;
            };
            if pattr.port_state() != PortState::Active {
                continue;
            }
            let (gid_index, exact) = match std::env::var("COLL_IB_GID_INDEX") {
                Ok(v) => (
                    v.trim().parse().map_err(|_| {
                        Error::Invalid(format!("COLL_IB_GID_INDEX='{v}' is not a number"))
                    })?,
                    true,
                ),
                Err(_) => match pick_gid(&context, port, pattr.gid_tbl_len().max(0) as u32, ip) {
                    Some(pick) => pick,
                    None => continue,
                },
            };
            let found = (
                dev.name(),
                context.clone(),
                port,
                gid_index,
                pattr.active_mtu(),
                pattr.attr.max_msg_sz,
            );
            if exact {
                return port_of(found);
            }
            fallback.get_or_insert(found);
        }
    }
    if let Some(found) = fallback {
        return port_of(found);
    }
    Err(no_device(match want_dev {
        Some(d) => format!("{d} (COLL_IB_HCA) has no active port with a RoCE v2 GID"),
        None => "no device with an active port and a RoCE v2 GID".into(),
    }))
}

/// A chosen device and port, with its GID index, MTU and longest message.
type Found = (String, Arc<DeviceContext>, u8, u32, Mtu, u32);

fn port_of((device, context, port, gid_index, mtu, max_msg): Found) -> Result<Port> {
    let gid = context.query_gid(port, gid_index).map_err(|e| {
        Error::Invalid(format!(
            "ibv_query_gid({device}, port {port}, index {gid_index}): {e}"
        ))
    })?;
    Ok(Port {
        device,
        context,
        port,
        gid,
        gid_index,
        mtu,
        max_msg,
    })
}

/// The RoCE v2 GID holding `ip` (IPv4-mapped; `true`: found), else the
/// first RoCE v2 GID with an IPv4-mapped address, else the first RoCE v2 GID.
fn pick_gid(context: &DeviceContext, port: u8, len: u32, ip: IpAddr) -> Option<(u32, bool)> {
    let v2: Vec<(u32, Gid)> = (0..len)
        .filter(|i| context.query_gid_type(port, *i).ok() == Some(ROCE_V2))
        .filter_map(|i| Some((i, context.query_gid(port, i).ok()?)))
        .filter(|(_, g)| g.raw != [0; 16])
        .collect();
    let mapped = |g: &Gid| std::net::Ipv6Addr::from(g.raw).to_ipv4_mapped();
    let want = match ip {
        IpAddr::V4(v4) => Some(v4),
        IpAddr::V6(v6) => v6.to_ipv4_mapped(),
    };
    if let Some((i, _)) = v2.iter().find(|(_, g)| want.is_some() && mapped(g) == want) {
        return Some((*i, true));
    }
    (v2.iter().find(|(_, g)| mapped(g).is_some()))
        .or_else(|| v2.first())
        .map(|(i, _)| (*i, false))
}

/// An MTU as its number of bytes.
pub(crate) fn mtu_bytes(mtu: Mtu) -> u32 {
    match mtu {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}
