//! An HTTP body fed from a channel: a thread (reading a file, or forwarding a guest's
//! answer) sends the pieces, hyper sends them on as they come, so nothing is held whole.
//! Pieces that are already waiting when hyper asks for the next go on together (up to
//! [`COALESCE_BYTES`]): one write, and behind TLS one record, instead of one per piece.

use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::body::{Bytes, Frame};
use tokio::sync::mpsc;

/// Most bytes of waiting pieces joined into one frame.
pub(crate) const COALESCE_BYTES: usize = 64 * 1024;

/// A body whose pieces arrive on a channel; an `Err` piece aborts the body (after the
/// pieces before it), the channel's close ends it.
pub(crate) struct ChannelBody {
    rx: mpsc::Receiver<std::io::Result<Bytes>>,
    /// An error that came behind pieces already joined: reported at the next poll.
    failed: Option<std::io::Error>,
}

impl ChannelBody {
    /// The body of the pieces `rx` will carry.
    pub(crate) fn new(rx: mpsc::Receiver<std::io::Result<Bytes>>) -> Self {
        Self { rx, failed: None }
    }
}

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if let Some(e) = self.failed.take() {
            return Poll::Ready(Some(Err(e)));
        }
        let first = match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(piece))) => piece,
            other => return other.map(|piece| piece.map(|r| r.map(Frame::data))),
        };
        let mut joined: Option<Vec<u8>> = None;
        while joined.as_ref().map_or(first.len(), Vec::len) < COALESCE_BYTES {
            match self.rx.try_recv() {
                Ok(Ok(piece)) => joined
                    .get_or_insert_with(|| first.to_vec())
                    .extend_from_slice(&piece),
                Ok(Err(e)) => {
                    self.failed = Some(e);
                    break;
                }
                Err(_) => break,
            }
        }
        let data = joined.map_or(first, Bytes::from);
        Poll::Ready(Some(Ok(Frame::data(data))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn waiting_pieces_go_on_together_and_an_error_behind_them_still_ends_the_body() {
        let (tx, rx) = mpsc::channel(8);
        for piece in ["data: 1\n\n", "data: 2\n\n", "data: 3\n\n"] {
            tx.send(Ok(Bytes::from(piece))).await.unwrap();
        }
        tx.send(Err(std::io::Error::other("the guest broke off")))
            .await
            .unwrap();
        let mut body = ChannelBody::new(rx);
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(
            frame.into_data().unwrap(),
            Bytes::from("data: 1\n\ndata: 2\n\ndata: 3\n\n")
        );
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(err.to_string(), "the guest broke off");
        drop(tx);
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_piece_alone_goes_on_at_once_and_joined_frames_stay_bounded() {
        let (tx, rx) = mpsc::channel(8);
        let mut body = ChannelBody::new(rx);
        tx.send(Ok(Bytes::from("one"))).await.unwrap();
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), Bytes::from("one"));
        let big = Bytes::from(vec![b'x'; 40 * 1024]);
        for _ in 0..3 {
            tx.send(Ok(big.clone())).await.unwrap();
        }
        drop(tx);
        let mut sizes = Vec::new();
        while let Some(frame) = body.frame().await {
            sizes.push(frame.unwrap().into_data().unwrap().len());
        }
        // Two joined (80 KiB: the join stops once past the bound), then the last alone.
        assert_eq!(sizes.iter().sum::<usize>(), 120 * 1024);
        assert!(sizes.len() >= 2, "{sizes:?}");
        assert!(
            sizes.iter().all(|s| *s <= COALESCE_BYTES + 40 * 1024),
            "{sizes:?}"
        );
    }
}
