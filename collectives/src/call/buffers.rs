//! The caller's memory for one call.

/// The caller's buffers for one call, as bytes.
pub enum Buffers<'a> {
    /// The result overwrites the input.
    InPlace(&'a mut [u8]),
    OutOfPlace {
        send: &'a [u8],
        recv: &'a mut [u8],
    },
}

impl<'a> Buffers<'a> {
    /// Out-of-place byte views of typed buffers.
    pub fn typed<T: crate::Element>(send: &'a [T], recv: &'a mut [T]) -> Self {
        Buffers::OutOfPlace {
            send: bytemuck::cast_slice(send),
            recv: bytemuck::cast_slice_mut(recv),
        }
    }

    pub(crate) fn split(self) -> (Option<&'a [u8]>, &'a mut [u8]) {
        match self {
            Buffers::InPlace(b) => (None, b),
            Buffers::OutOfPlace { send, recv } => (Some(send), recv),
        }
    }
}
