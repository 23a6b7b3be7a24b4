//! The fake guest agents the front door tests talk to: one listener per tenant on its
//! hybrid-vsock socket, answering `infer-stream` requests as the n-gram payload would, plus
//! the hostile answers (`huge`, `garbled`, `endless`, `hold`) that the tests ask for by prompt.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tenantvm_agent_protocol::{
    decode_body, encode_data, encode_frame, read_frame, HttpHead, Outcome, Reply,
    Request as AgentRequest, RequestFrame, ResponseFrame,
};

/// What the fake guests answer to a prompt starting `secret-prompt`.
pub(super) const COMPLETION_MARKER: &str = "secret-completion-5e1f9c";

/// What the fake guests answer on `/v1/embeddings` (llama-server without `--embeddings`).
pub(super) const EMBEDDINGS_REFUSAL: &str = r#"{"error":{"code":501,"message":"This server does not support embeddings. Start it with `--embeddings`","type":"not_supported_error"}}"#;

/// The events of a streamed answer to the prompt `bytes`: raw bytes that are not valid
/// UTF-8 on their own (the first two split "é", 0xC3 0xA9; the third holds 0xFF).
pub(super) const BYTE_TOKEN_EVENTS: [&[u8]; 4] = [
    b"data: {\"choices\":[{\"text\":\"\xC3",
    b"\xA9\"}]}\n\n",
    b"data: {\"choices\":[{\"text\":\"\xFF\"}]}\n\n",
    b"data: [DONE]\n\n",
];

/// What the fake guests saw, shared with the test.
#[derive(Default)]
pub(super) struct Guests {
    /// Streams in progress right now, and the most seen at once, per tenant.
    pub(super) open: Mutex<HashMap<String, (usize, usize)>>,
    /// Endless streams that ended because the host closed them.
    pub(super) cut_off: AtomicUsize,
    /// `hold` requests wait until this is nonzero.
    pub(super) release: AtomicUsize,
}

fn write_head(s: &mut UnixStream, id: u64, status: u16, content_type: &str) -> std::io::Result<()> {
    s.write_all(
        &encode_frame(&ResponseFrame {
            id,
            outcome: Outcome::Ok(Reply::InferHead(HttpHead {
                status,
                headers: vec![("Content-Type".into(), content_type.into())],
            })),
        })
        .unwrap(),
    )
}

fn write_data(s: &mut UnixStream, data: &[u8]) -> std::io::Result<()> {
    s.write_all(&encode_data(data).unwrap())
}

/// One streamed request, as the n-gram payload would answer it (model `<tenant>-model`).
fn serve_request(tenant: &str, guests: &Guests, mut s: UnixStream) -> std::io::Result<()> {
    let mut line = [0u8; 13];
    s.read_exact(&mut line)?;
    assert_eq!(&line, b"CONNECT 1024\n");
    s.write_all(b"OK 1073741824\n")?;
    let req: RequestFrame = decode_body(&read_frame(&mut s).unwrap()).unwrap();
    let AgentRequest::InferStream(http) = req.request else {
        panic!("the front door sent {:?}", req.request);
    };
    let id = req.id;
    let model = format!("{tenant}-model");
    if http.path == "/v1/models" {
        write_head(&mut s, id, 200, "application/json")?;
        write_data(
            &mut s,
            json!({"object": "list", "data": [{"id": model, "object": "model"}]})
                .to_string()
                .as_bytes(),
        )?;
        return write_data(&mut s, b"");
    }
    // Nothing but the route, the JSON body and content headers reaches the guest.
    assert!(
        http.headers
            .iter()
            .all(|(n, _)| n == "Content-Type" || n == "Accept"),
        "{:?}",
        http.headers
    );
    let body: Value = serde_json::from_str(&http.body).unwrap();
    if http.path == "/v1/embeddings" {
        // As llama-server started without --embeddings answers: its own OpenAI-shaped
        // error, which must reach the client unchanged.
        write_head(&mut s, id, 501, "application/json; charset=utf-8")?;
        write_data(&mut s, EMBEDDINGS_REFUSAL.as_bytes())?;
        return write_data(&mut s, b"");
    }
    if body["model"] != model.as_str() {
        write_head(&mut s, id, 404, "application/json")?;
        let name = body["model"].as_str().unwrap_or("");
        write_data(
            &mut s,
            json!({"error": {"message": format!("The model `{name}` does not exist"),
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})
            .to_string()
            .as_bytes(),
        )?;
        return write_data(&mut s, b"");
    }
    let prompt = body["prompt"]
        .as_str()
        .or(body["messages"][0]["content"].as_str())
        .unwrap_or("")
        .to_string();
    {
        let mut open = guests.open.lock().unwrap();
        let e = open.entry(tenant.to_string()).or_default();
        e.0 += 1;
        e.1 = e.1.max(e.0);
    }
    let result = (|| {
        if prompt == "huge" {
            // A hostile payload: a data frame announced far over the cap, then silence.
            write_head(&mut s, id, 200, "text/event-stream")?;
            write_data(&mut s, b"data: {\"choices\":[{\"text\":\"x\"}]}\n\n")?;
            let mut h = tenantvm_agent_protocol::MAGIC.to_vec();
            h.extend_from_slice(&tenantvm_agent_protocol::PROTOCOL_VERSION.to_be_bytes());
            h.extend_from_slice(&0u16.to_be_bytes());
            h.extend_from_slice(&(tenantvm_agent_protocol::MAX_BODY_LEN).to_be_bytes());
            s.write_all(&h)?;
            s.write_all(&vec![b'z'; 256 * 1024])?;
            std::thread::sleep(Duration::from_secs(5));
            return Ok(());
        }
        if prompt == "garbled" {
            // Not a frame at all after the head.
            write_head(&mut s, id, 200, "text/event-stream")?;
            s.write_all(b"HTTP/1.1 200 OK\r\n\r\ndata: [DONE]\n\n")?;
            std::thread::sleep(Duration::from_secs(5));
            return Ok(());
        }
        if prompt == "hold" {
            while guests.release.load(Ordering::SeqCst) == 0 {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if body["stream"] == true {
            write_head(&mut s, id, 200, "text/event-stream")?;
            if prompt == "endless" {
                loop {
                    if write_data(&mut s, b"data: {\"choices\":[{\"text\":\" more\"}]}\n\n")
                        .is_err()
                    {
                        guests.cut_off.fetch_add(1, Ordering::SeqCst);
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            if prompt == "bytes" {
                // A random-weight model's byte tokens: one character's UTF-8 split across
                // two events and frames, and a byte that is no UTF-8 at all.
                for piece in BYTE_TOKEN_EVENTS {
                    write_data(&mut s, piece)?;
                }
                return write_data(&mut s, b"");
            }
            let words = if prompt.starts_with("secret-prompt") {
                [COMPLETION_MARKER; 3]
            } else {
                ["one", "two", "three"]
            };
            for word in words {
                write_data(&mut s, format!("data: {}\n\n", json!({"object": "chat.completion.chunk", "choices": [{"delta": {"content": word}}]})).as_bytes())?;
                std::thread::sleep(Duration::from_millis(30));
            }
            write_data(&mut s, format!("data: {}\n\n", json!({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})).as_bytes())?;
            write_data(&mut s, b"data: [DONE]\n\n")?;
            return write_data(&mut s, b"");
        }
        write_head(&mut s, id, 200, "application/json")?;
        let text = if prompt.starts_with("secret-prompt") {
            COMPLETION_MARKER
        } else {
            " answer"
        };
        write_data(
            &mut s,
            json!({"object": "text_completion", "model": model, "choices": [{"text": text}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
            .to_string()
            .as_bytes(),
        )?;
        write_data(&mut s, b"")
    })();
    guests.open.lock().unwrap().get_mut(tenant).unwrap().0 -= 1;
    result
}

pub(super) fn serve_guest(tenant: String, listener: UnixListener, guests: Arc<Guests>) {
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(s) = s else { return };
            let (tenant, guests) = (tenant.clone(), guests.clone());
            std::thread::spawn(move || {
                let _ = serve_request(&tenant, &guests, s);
            });
        }
    });
}
