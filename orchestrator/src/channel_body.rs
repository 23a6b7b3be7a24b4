//! An HTTP body fed from a channel: a thread (reading a file, or forwarding a guest's
//! answer) sends the pieces, hyper sends them on as they come, so nothing is held whole.

use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::body::{Bytes, Frame};
use tokio::sync::mpsc;

/// A body whose pieces arrive on `0`; an `Err` piece aborts the body, the channel's close
/// ends it.
pub(crate) struct ChannelBody(pub(crate) mpsc::Receiver<std::io::Result<Bytes>>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|piece| piece.map(|r| r.map(Frame::data)))
    }
}
