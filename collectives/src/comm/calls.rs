//! The typed calls: each builds its [`CallArgs`] and buffers and takes the
//! communicator's one path.

use transport::Rank;

use crate::call::args::{CallArgs, VarCounts};
use crate::{Buffers, Collective, Communicator, DataType, Element, ReduceOp, Result};

impl Communicator {
    /// `recv[i] = op over ranks of send[i]`, on every rank.
    pub fn all_reduce<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.all_reduce_bytes(Buffers::typed(send, recv), T::DTYPE, op)
    }

    /// `buf[i] = op over ranks of buf[i]`, on every rank.
    pub fn all_reduce_in_place<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(in_place(buf), T::DTYPE, op)
    }

    /// AllReduce on byte buffers holding `dtype` elements.
    pub fn all_reduce_bytes(
        &mut self,
        bufs: Buffers<'_>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        self.call(&CallArgs::new(Collective::AllReduce, dtype).op(op), bufs)
    }

    /// Block `j` of `send` goes to rank `j`; block `j` of `recv` comes from
    /// rank `j`. Lengths must be equal and divisible by the rank count.
    pub fn all_to_all<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_to_all_bytes(Buffers::typed(send, recv), T::DTYPE)
    }

    /// AllToAll where the received blocks replace the sent ones.
    pub fn all_to_all_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<()> {
        self.all_to_all_bytes(in_place(buf), T::DTYPE)
    }

    /// AllToAll on byte buffers holding `dtype` elements.
    pub fn all_to_all_bytes(&mut self, bufs: Buffers<'_>, dtype: DataType) -> Result<()> {
        self.call(&CallArgs::new(Collective::AllToAll, dtype), bufs)
    }

    /// AllToAll with a block of its own size per pair of ranks (see
    /// [`VarCounts`]; [`VarCounts::packed`] for blocks one after another).
    /// Rank `i`'s `send_counts[j]` must equal rank `j`'s `recv_counts[i]`;
    /// where they differ, both ranks get an error naming the other.
    pub fn all_to_all_v<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        counts: &VarCounts,
    ) -> Result<()> {
        let args = CallArgs::all_to_all_v(T::DTYPE, counts.clone());
        self.call(&args, Buffers::typed(send, recv))
    }

    /// `recv = block rank of (op over ranks of send)`, where `send` holds
    /// one block of `recv.len()` elements per rank.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let args = CallArgs::new(Collective::ReduceScatter, T::DTYPE).op(op);
        self.call(&args, Buffers::typed(send, recv))
    }

    /// Reduce-scatter whose result lands in block `rank` of `buf` (NCCL's
    /// in-place convention: `recvbuff == sendbuff + rank * recvcount`); the
    /// other blocks are left with partial results.
    pub fn reduce_scatter_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let args = CallArgs::new(Collective::ReduceScatter, T::DTYPE).op(op);
        self.call(&args, in_place(buf))
    }

    /// Block `j` of `recv` (each `send.len()` elements) is rank `j`'s `send`.
    pub fn all_gather<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        let args = CallArgs::new(Collective::AllGather, T::DTYPE);
        self.call(&args, Buffers::typed(send, recv))
    }

    /// All-gather where each rank's contribution is already block `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<()> {
        self.call(
            &CallArgs::new(Collective::AllGather, T::DTYPE),
            in_place(buf),
        )
    }

    /// Every rank's `buf` becomes rank `root`'s.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: Rank) -> Result<()> {
        let args = CallArgs::new(Collective::Broadcast, T::DTYPE).root(root);
        self.call(&args, in_place(buf))
    }

    /// `recv[i] = op over ranks of send[i]` on rank `root`. Every rank passes
    /// a `recv` of the same length: on the others it is used as workspace and
    /// holds partial results afterwards.
    pub fn reduce<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<()> {
        let args = CallArgs::new(Collective::Reduce, T::DTYPE)
            .op(op)
            .root(root);
        self.call(&args, Buffers::typed(send, recv))
    }

    /// Reduce where `buf` is both input and, on `root`, result.
    pub fn reduce_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<()> {
        let args = CallArgs::new(Collective::Reduce, T::DTYPE)
            .op(op)
            .root(root);
        self.call(&args, in_place(buf))
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<()> {
        let args = CallArgs::new(Collective::Barrier, DataType::U8);
        self.call(&args, Buffers::InPlace(&mut []))
    }

    /// Sends `buf` to rank `peer`, whose matching [`recv`](Self::recv) must
    /// expect the same count and datatype. Messages between two ranks are
    /// matched in order, independently of collectives and of other pairs.
    /// Returns once the data left `buf` (small messages are buffered, large
    /// ones wait for the receiver).
    pub fn send<T: Element>(&mut self, buf: &[T], peer: Rank) -> Result<()> {
        let bufs = Buffers::OutOfPlace {
            send: bytemuck::cast_slice(buf),
            recv: &mut [],
        };
        self.call(&CallArgs::send_to(T::DTYPE, peer), bufs)
    }

    /// Receives into `buf` the next message rank `peer` sends this rank.
    pub fn recv<T: Element>(&mut self, buf: &mut [T], peer: Rank) -> Result<()> {
        self.call(&CallArgs::recv_from(T::DTYPE, peer), in_place(buf))
    }

    /// Any collective on byte buffers: `op` for those that reduce, `root`
    /// for broadcast and reduce (see the typed calls for each one's buffers).
    /// Inlined into the caller, which stores `root` in two words that a
    /// call would read back in one (a failed store forward, ~4 ns a call).
    #[inline]
    pub fn collective_bytes(
        &mut self,
        collective: Collective,
        bufs: Buffers<'_>,
        dtype: DataType,
        op: Option<ReduceOp>,
        root: Option<Rank>,
    ) -> Result<()> {
        let args = CallArgs {
            op,
            root,
            ..CallArgs::new(collective, dtype)
        };
        self.call(&args, bufs)
    }

    /// Keeps `buf` registered with the transport until
    /// [`deregister`](Self::deregister), so calls on it skip registration
    /// (which costs a page pinning per call over verbs).
    pub fn register<T: Element>(&mut self, buf: &[T]) -> Result<()> {
        self.register_bytes(bytemuck::cast_slice(buf))
    }

    /// Forgets a registration made by [`register`](Self::register).
    pub fn deregister<T: Element>(&mut self, buf: &[T]) {
        self.deregister_bytes(bytemuck::cast_slice(buf))
    }
}

fn in_place<T: Element>(buf: &mut [T]) -> Buffers<'_> {
    Buffers::InPlace(bytemuck::cast_slice_mut(buf))
}
