//! Meeting through MPI itself (the `mpi` cargo feature), the way nccl-tests
//! hands NCCL's unique id around: rank 0 starts the rendezvous and
//! broadcasts its address with MPI_Bcast. MPI also tells whether this binary
//! was started by its own MPI's launcher: one linked with Open MPI under
//! MPICH's hydra (or the reverse) sees a world of one rank in every process,
//! which would silently run N jobs of one rank; that is an error here.

use std::sync::Once;

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::Bootstrap;

/// Bytes of the broadcast announcement (`ip:port/token`, NUL-padded).
const ANNOUNCEMENT: usize = 256;

/// Broadcasts rank 0's `announcement` (`Err` aborts every rank with it)
/// and returns it on every rank.
pub(crate) fn broadcast(
    boot: &Bootstrap,
    announcement: Option<Result<String, String>>,
) -> Result<String, String> {
    let world = world()?;
    let (size, rank) = (world.size() as usize, world.rank() as usize);
    if size != boot.size || rank != boot.rank {
        // "Open MPI v4.1.4, package: ..." or "MPICH Version:\t4.0.2\n...": its name.
        let version = mpi::environment::library_version().unwrap_or_default();
        let first = version
            .lines()
            .next()
            .unwrap_or("")
            .split(',')
            .next()
            .unwrap_or("");
        let lib = first.split_whitespace().collect::<Vec<_>>().join(" ");
        return Err(format!(
            "this binary is linked with {lib}, which sees rank {rank} of {size}, but {} started it as rank {} of {}: \
             it was built against another MPI than the launcher's; use the mpirun of the MPI it was built with \
             (MPICC=mpicc.mpich at build time selects MPICH), or build without the mpi feature",
            boot.source, boot.rank, boot.size
        ));
    }
    let mut buf = [0u8; ANNOUNCEMENT];
    if let Some(text) = announcement {
        // A leading '!' carries rank 0's failure to the others.
        let text = text.unwrap_or_else(|e| format!("!{e}"));
        let n = text.len().min(ANNOUNCEMENT);
        buf[..n].copy_from_slice(&text.as_bytes()[..n]);
    }
    world.process_at_rank(0).broadcast_into(&mut buf[..]);
    let text = String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .to_string();
    match text.strip_prefix('!') {
        Some(e) => Err(format!("rank 0 could not start the rendezvous: {e}")),
        None => Ok(text),
    }
}

/// MPI's world, initialising MPI if the application has not; then MPI is
/// finalized when the process exits (Open MPI's mpirun reports a process
/// that exits without MPI_Finalize as failed).
fn world() -> Result<SimpleCommunicator, String> {
    static START: Once = Once::new();
    let mut failed = false;
    START.call_once(|| {
        if mpi::environment::is_initialized() {
            return;
        }
        match mpi::initialize() {
            Some(universe) => {
                // Finalized at exit instead of when this value would drop.
                std::mem::forget(universe);
                // SAFETY: registers a plain function with no captured state.
                unsafe { libc::atexit(finalize) };
            }
            None => failed = true,
        }
    });
    if failed || !mpi::environment::is_initialized() {
        return Err("MPI_Init failed".into());
    }
    Ok(SimpleCommunicator::world())
}

extern "C" fn finalize() {
    if !mpi::environment::is_finalized() {
        // SAFETY: MPI is initialized (we did it) and not finalized; this runs
        // once, at exit, after every communication of ours has ended.
        unsafe {
            mpi::ffi::MPI_Finalize();
        }
    }
}
