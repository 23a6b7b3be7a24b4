//! Writing answer frames to the host: the one place an answer is encoded, so that one too
//! large to encode still reaches the host as a `too-large` error. The stream server and
//! the agent's streaming answers both write through it.

use std::io::Write;

use tenantvm_agent_protocol::{encode_frame, AgentFailure, ErrorCode, Outcome, ResponseFrame};

/// An error answer to request `id`.
pub(crate) fn error_frame(id: u64, code: ErrorCode, message: String) -> ResponseFrame {
    ResponseFrame {
        id,
        outcome: Outcome::Err(AgentFailure { code, message }),
    }
}

/// Writes one answer frame (an unencodable one becomes a `too-large` error); false when
/// the host is gone.
pub(crate) fn send(w: &mut (impl Write + ?Sized), resp: &ResponseFrame) -> bool {
    let frame = match encode_frame(resp) {
        Ok(f) => f,
        Err(e) => match encode_frame(&error_frame(resp.id, ErrorCode::TooLarge, e.to_string())) {
            Ok(f) => f,
            Err(_) => return false,
        },
    };
    w.write_all(&frame).and_then(|()| w.flush()).is_ok()
}
