//! The front door against a live server: a real TLS listener on a TCP port, clients that
//! speak HTTP/1.1 over rustls as an OpenAI client would, and tenants on the fake host whose
//! guest agents are served by this test over hybrid-vsock sockets (listened on as each
//! tenant's uid, which the daemon's peer check wants: needs root).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tenantvm_agent_protocol::{
    decode_body, encode_data, encode_frame, read_frame, HttpHead, Outcome, Reply,
    Request as AgentRequest, RequestFrame, ResponseFrame,
};

// The same helper the API's isolation tests load (a test-only file shared by path).
#[allow(clippy::duplicate_mod)]
#[path = "../../tests/support/peercred.rs"]
mod peercred;

use crate::auth::Caller;
use crate::domain::spec::TenantSpec;
use crate::tenant::fault::FaultHook;
use crate::tenant::service::TenantCommand;
use crate::tenant::test_utils::Harness;

/// What the fake guests answer to a prompt starting `secret-prompt`.
const COMPLETION_MARKER: &str = "secret-completion-5e1f9c";

/// What the fake guests saw, shared with the test.
#[derive(Default)]
struct Guests {
    /// Streams in progress right now, and the most seen at once, per tenant.
    open: Mutex<HashMap<String, (usize, usize)>>,
    /// Endless streams that ended because the host closed them.
    cut_off: AtomicUsize,
    /// `hold` requests wait until this is nonzero.
    release: AtomicUsize,
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

fn serve_guest(tenant: String, listener: UnixListener, guests: Arc<Guests>) {
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

/// A running front door over a harness with tenants `alice` and `bob`, each with a key.
struct Door {
    _rt: tokio::runtime::Runtime,
    h: Harness,
    addr: SocketAddr,
    client: Arc<rustls::ClientConfig>,
    keys: HashMap<&'static str, String>,
    guests: Arc<Guests>,
}

fn door(quotas: &[(&'static str, &str)]) -> Option<Door> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tenantvm_skip::record_skip!("needs root to serve agent sockets as tenant uids");
        return None;
    }
    let h = Harness::new(FaultHook::default());
    h.host.state().agent_vsock = true;
    let guests = Arc::new(Guests::default());
    let mut keys = HashMap::new();
    for (name, q) in quotas {
        let spec = TenantSpec::from_toml(&format!(
            "name = \"{name}\"\n[image]\nname = \"hello\"\n[quotas]\n{q}\n"
        ))
        .unwrap();
        h.svc
            .execute(&Caller::Admin, TenantCommand::Create(spec))
            .unwrap();
    }
    h.svc.wait_idle();
    for (name, _) in quotas {
        let t = h.svc.store().tenant(name).unwrap().unwrap();
        h.svc
            .store()
            .set_guest(t.id, crate::domain::GuestKind::Agent)
            .unwrap();
        let ctx = h.svc.ctx();
        let vm = crate::tenant::context::Tenant::load(&ctx, &t)
            .unwrap()
            .vm
            .unwrap();
        let sock = crate::tenant::steps::guest::agent_endpoint(ctx.backend, &vm)
            .path()
            .expect("a socket endpoint")
            .to_path_buf();
        std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
        serve_guest(
            name.to_string(),
            peercred::listen_as(&sock, vm.uid).unwrap(),
            guests.clone(),
        );
        let (key, _, _) = super::keys::create(h.svc.store(), t.id).unwrap();
        keys.insert(*name, key);
    }
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (cert_pem, key_pem) = (h.dir.path().join("cert.pem"), h.dir.path().join("key.pem"));
    std::fs::write(&cert_pem, cert.cert.pem()).unwrap();
    std::fs::write(&key_pem, cert.key_pair.serialize_pem()).unwrap();
    let tls = super::tls_config(&cert_pem, &key_pem).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let client = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let rt = crate::daemon::runtime().unwrap();
    let listener = rt
        .block_on(super::bind("127.0.0.1:0".parse().unwrap()))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(super::serve(
        listener,
        tls,
        h.svc.clone(),
        std::future::pending(),
    ));
    Some(Door {
        _rt: rt,
        h,
        addr,
        client,
        keys,
        guests,
    })
}

type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// A response read as far as its head; the body is read with [`Response::body`] or
/// piece by piece with [`Response::next_chunk`].
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    r: BufReader<Tls>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The next chunk of a chunked body (None at its end).
    fn next_chunk(&mut self) -> Option<Vec<u8>> {
        let mut line = String::new();
        self.r.read_line(&mut line).ok()?;
        let size = usize::from_str_radix(line.trim(), 16).ok()?;
        let mut data = vec![0u8; size + 2];
        self.r.read_exact(&mut data).ok()?;
        data.truncate(size);
        (size > 0).then_some(data)
    }

    fn body(mut self) -> Vec<u8> {
        if let Some(len) = self.header("content-length") {
            let mut data = vec![0u8; len.parse().unwrap()];
            self.r.read_exact(&mut data).unwrap();
            return data;
        }
        let mut all = Vec::new();
        while let Some(c) = self.next_chunk() {
            all.extend(c);
        }
        all
    }

    fn json(self) -> Value {
        serde_json::from_slice(&self.body()).unwrap()
    }
}

impl Door {
    fn connect(&self) -> Tls {
        let tcp = TcpStream::connect(self.addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let conn =
            rustls::ClientConnection::new(self.client.clone(), "localhost".try_into().unwrap())
                .unwrap();
        rustls::StreamOwned::new(conn, tcp)
    }

    fn send(&self, method: &str, path: &str, key: Option<&str>, body: Option<&[u8]>) -> Response {
        let mut s = self.connect();
        let mut head =
            format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
        if let Some(k) = key {
            head.push_str(&format!("Authorization: Bearer {k}\r\n"));
        }
        if let Some(b) = body {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).unwrap();
        if let Some(b) = body {
            s.write_all(b).unwrap();
        }
        s.flush().unwrap();
        let mut r = BufReader::new(s);
        let mut status_line = String::new();
        r.read_line(&mut status_line).unwrap();
        let status: u16 = status_line.split(' ').nth(1).unwrap().parse().unwrap();
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (n, v) = line.split_once(':').unwrap();
            headers.push((n.to_string(), v.trim().to_string()));
        }
        Response { status, headers, r }
    }

    fn post(&self, path: &str, tenant: &str, body: Value) -> Response {
        self.send(
            "POST",
            path,
            Some(&self.keys[tenant]),
            Some(body.to_string().as_bytes()),
        )
    }
}

fn error_code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

#[test]
fn openai_routes_stream_through_and_every_bad_request_gets_openais_error_shape() {
    let Some(d) = door(&[("alice", "max_request_bytes = 2048"), ("bob", "")]) else {
        return;
    };

    // GET /v1/models and a completion, with alice's key, reach alice's guest.
    let models = d.send("GET", "/v1/models", Some(&d.keys["alice"]), None);
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], "alice-model");
    let c = d.post(
        "/v1/completions",
        "alice",
        json!({"model": "alice-model", "prompt": "hi", "max_tokens": 4}),
    );
    assert_eq!(c.status, 200);
    let v = c.json();
    assert_eq!(v["choices"][0]["text"], " answer");
    assert_eq!(v["usage"]["total_tokens"], 2);

    // Streaming: server-sent events arrive one by one, usage last, then [DONE].
    let mut s = d.post(
        "/v1/chat/completions",
        "alice",
        json!({"model": "alice-model", "stream": true,
        "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(s.status, 200);
    assert_eq!(s.header("content-type"), Some("text/event-stream"));
    let mut events = Vec::new();
    while let Some(chunk) = s.next_chunk() {
        events.push(String::from_utf8(chunk).unwrap());
    }
    assert!(
        events.len() >= 4,
        "the answer came in {} piece(s): {events:?}",
        events.len()
    );
    let all = events.concat();
    assert!(all.ends_with("data: [DONE]\n\n"), "{all}");
    assert!(all.contains("\"total_tokens\":4"), "{all}");

    // Keys: none, malformed, unknown: the same 401.
    for key in [
        None,
        Some("sk-not-ours"),
        Some("tvk-0000000000000000000000000000000000000000000000000000000000000000"),
    ] {
        let r = d.send("GET", "/v1/models", key, None);
        assert_eq!(r.status, 401);
        assert_eq!(error_code(&r.json()), "invalid_api_key");
    }
    // The admin token is no inference key.
    let admin = crate::auth::ensure_admin_token(d.h.svc.store(), d.h.dir.path())
        .unwrap()
        .unwrap();
    let admin = std::fs::read_to_string(admin).unwrap();
    assert_eq!(
        d.send("GET", "/v1/models", Some(admin.trim()), None).status,
        401
    );

    // bob's key asking for alice's model gets exactly what an unknown model gets.
    let theirs = d.post(
        "/v1/completions",
        "bob",
        json!({"model": "alice-model", "prompt": "x"}),
    );
    let unknown = d.post(
        "/v1/completions",
        "bob",
        json!({"model": "no-such-model", "prompt": "x"}),
    );
    assert_eq!((theirs.status, unknown.status), (404, 404));
    let (theirs, unknown) = (theirs.json(), unknown.json());
    assert_eq!(error_code(&theirs), "model_not_found");
    assert_eq!(error_code(&unknown), "model_not_found");
    assert_eq!(theirs["error"]["type"], unknown["error"]["type"]);

    // Malformed JSON, a JSON non-object, wrong method, unknown route, oversized body.
    for bad in [&b"{not json"[..], b"[1,2]"] {
        let r = d.send("POST", "/v1/completions", Some(&d.keys["alice"]), Some(bad));
        assert_eq!(r.status, 400);
        assert_eq!(error_code(&r.json()), "invalid_json");
    }
    let r = d.send("GET", "/v1/completions", Some(&d.keys["alice"]), None);
    assert_eq!(r.status, 405);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = d.send(
        "POST",
        "/v1/tenants/alice/stop",
        Some(&d.keys["alice"]),
        Some(b"{}"),
    );
    assert_eq!(r.status, 404);
    assert_eq!(error_code(&r.json()), "unknown_url");
    let big = json!({"model": "alice-model", "prompt": "p".repeat(4096)});
    let r = d.post("/v1/completions", "alice", big.clone());
    assert_eq!(r.status, 413);
    assert_eq!(error_code(&r.json()), "request_too_large");
    // bob's limit is the default (1 MiB): the same body passes.
    let mut big = big;
    big["model"] = json!("bob-model");
    assert_eq!(d.post("/v1/completions", "bob", big).status, 200);

    // TLS is required: plain HTTP on the port gets no HTTP answer.
    let mut plain = TcpStream::connect(d.addr).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    plain
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let _ = plain.read_to_end(&mut got);
    assert!(
        !got.starts_with(b"HTTP/"),
        "{}",
        String::from_utf8_lossy(&got)
    );

    // Metrics: alice's key reads alice's series only, tokens from the payload's usage
    // counts (1 + 1 from the completion, 1 + 3 from the stream), refusals by reason.
    let m = d.send("GET", "/metrics", Some(&d.keys["alice"]), None);
    assert_eq!(m.status, 200);
    let text = String::from_utf8(m.body()).unwrap();
    assert!(!text.contains("bob"), "{text}");
    assert!(
        text.contains("tenantvm_frontdoor_tokens_total{tenant=\"alice\",kind=\"completion\"} 4"),
        "{text}"
    );
    assert!(
        text.contains("tenantvm_frontdoor_tokens_total{tenant=\"alice\",kind=\"prompt\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("tenantvm_frontdoor_refusals_total{tenant=\"alice\",reason=\"size\"} 1"),
        "{text}"
    );
    assert!(text.contains("tenantvm_frontdoor_requests_total{tenant=\"alice\",route=\"chat.completions\",status=\"200\"} 1"), "{text}");
    assert!(
        text.contains("tenantvm_frontdoor_first_byte_seconds_count{tenant=\"alice\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("tenantvm_frontdoor_in_flight{tenant=\"alice\"} 0"),
        "{text}"
    );
    assert_eq!(d.send("GET", "/metrics", None, None).status, 401);

    // A revoked key stops working at once.
    let alice = d.h.svc.store().tenant("alice").unwrap().unwrap();
    let id = d.h.svc.store().inference_keys(alice.id).unwrap()[0].id;
    assert!(d.h.svc.store().revoke_inference_key(alice.id, id).unwrap());
    assert_eq!(
        d.send("GET", "/v1/models", Some(&d.keys["alice"]), None)
            .status,
        401
    );
}

#[test]
fn quotas_hold_at_the_front_door_and_a_client_that_leaves_frees_its_place() {
    let Some(d) = door(&[
        ("alice", "max_concurrency = 2\nrequests_per_s = 1000"),
        ("bob", "requests_per_s = 1"),
    ]) else {
        return;
    };
    let hold = json!({"model": "alice-model", "prompt": "hold"});
    // Two requests really in flight at once in alice's guest; a third is refused at once.
    let held: Vec<_> = (0..2)
        .map(|_| {
            let d_addr = (d.addr, d.client.clone(), d.keys["alice"].clone());
            let body = hold.to_string();
            std::thread::spawn(move || {
                let d = Door::detached(d_addr);
                d.status_of("/v1/completions", &body)
            })
        })
        .collect();
    let until = Instant::now() + Duration::from_secs(10);
    while d
        .guests
        .open
        .lock()
        .unwrap()
        .get("alice")
        .map_or(0, |e| e.0)
        < 2
    {
        assert!(
            Instant::now() < until,
            "two requests never were in flight at once"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let refused = d.post("/v1/completions", "alice", hold.clone());
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(error_code(&refused.json()), "concurrency_limit_exceeded");
    // bob is not slowed by alice's full house.
    assert_eq!(
        d.post(
            "/v1/completions",
            "bob",
            json!({"model": "bob-model", "prompt": "x"})
        )
        .status,
        200
    );
    // ...and bob's own rate (1 per second) refuses his next request at once.
    let r = d.post(
        "/v1/completions",
        "bob",
        json!({"model": "bob-model", "prompt": "x"}),
    );
    assert_eq!(r.status, 429);
    assert!(r.header("retry-after").is_some());
    assert_eq!(error_code(&r.json()), "rate_limit_exceeded");
    d.guests.release.store(1, Ordering::SeqCst);
    for h in held {
        assert_eq!(h.join().unwrap(), 200);
    }
    assert_eq!(d.guests.open.lock().unwrap()["alice"].1, 2);

    // A client that leaves mid-stream: the guest connection is closed and the place freed.
    let mut s = d.post(
        "/v1/completions",
        "alice",
        json!({"model": "alice-model", "prompt": "endless", "stream": true}),
    );
    assert_eq!(s.status, 200);
    assert!(s.next_chunk().is_some());
    drop(s);
    let until = Instant::now() + Duration::from_secs(10);
    while d.guests.cut_off.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < until,
            "the endless stream was not cut off after its client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Both places are free again: two held requests are in flight at once.
    let both: Vec<_> = (0..2)
        .map(|_| {
            let d_addr = (d.addr, d.client.clone(), d.keys["alice"].clone());
            let body = hold.to_string();
            std::thread::spawn(move || Door::detached(d_addr).status_of("/v1/completions", &body))
        })
        .collect();
    for h in both {
        assert_eq!(h.join().unwrap(), 200);
    }
}

/// A client of a running door from another thread.
struct Detached {
    addr: SocketAddr,
    client: Arc<rustls::ClientConfig>,
    key: String,
}

impl Door {
    fn detached((addr, client, key): (SocketAddr, Arc<rustls::ClientConfig>, String)) -> Detached {
        Detached { addr, client, key }
    }
}

impl Detached {
    fn status_of(&self, path: &str, body: &str) -> u16 {
        let tcp = TcpStream::connect(self.addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let conn =
            rustls::ClientConnection::new(self.client.clone(), "localhost".try_into().unwrap())
                .unwrap();
        let mut s = rustls::StreamOwned::new(conn, tcp);
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.key,
            body.len()
        )
        .unwrap();
        s.flush().unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        line.split(' ').nth(1).unwrap().parse().unwrap()
    }
}

#[test]
fn keys_are_managed_through_the_api_by_their_tenant_and_revoked_at_departure() {
    use axum::body::Body;
    use tower::ServiceExt;
    let h = Harness::new(FaultHook::default());
    let admin = crate::auth::ensure_admin_token(h.svc.store(), h.dir.path())
        .unwrap()
        .unwrap();
    let admin = std::fs::read_to_string(admin).unwrap().trim().to_string();
    let rt = crate::daemon::runtime().unwrap();
    let app = crate::api::router(h.svc.clone());
    let call = |method: &str, uri: &str, token: &str| -> (u16, Value) {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .header("authorization", format!("Bearer {token}"));
        let body = if method == "POST" {
            req.header("content-type", "application/json")
                .body(Body::from("{}"))
        } else {
            req.body(Body::empty())
        }
        .unwrap();
        rt.block_on(async {
            let resp = app.clone().oneshot(body).await.unwrap();
            let status = resp.status().as_u16();
            let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
                .await
                .unwrap();
            (
                status,
                serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            )
        })
    };
    let mut tokens = HashMap::new();
    for name in ["alice", "bob"] {
        let spec =
            TenantSpec::from_toml(&format!("name = \"{name}\"\n[image]\nname = \"hello\"\n"))
                .unwrap();
        match h
            .svc
            .execute(&Caller::Admin, TenantCommand::Create(spec))
            .unwrap()
        {
            crate::tenant::service::CommandOutcome::Created(c) => tokens.insert(name, c.token),
            other => panic!("{other:?}"),
        };
    }
    h.svc.wait_idle();
    // alice's own token makes a key; the key resolves to alice at the front door.
    let (s, made) = call("POST", "/v1/tenants/alice/keys", &tokens["alice"]);
    assert_eq!(s, 201, "{made}");
    let key = made["key"].as_str().unwrap().to_string();
    assert!(key.starts_with(super::keys::KEY_PREFIX));
    let bearer = format!("Bearer {key}");
    assert_eq!(
        super::keys::authenticate(h.svc.store(), Some(&bearer))
            .unwrap()
            .name
            .as_str(),
        "alice"
    );
    // The admin makes a second one; the list shows both by id and first characters only.
    let (s, _) = call("POST", "/v1/tenants/alice/keys", &admin);
    assert_eq!(s, 201);
    let (s, list) = call("GET", "/v1/tenants/alice/keys", &tokens["alice"]);
    assert_eq!(s, 200);
    assert_eq!(list["keys"].as_array().unwrap().len(), 2);
    assert!(
        !list.to_string().contains(&key),
        "a listed key must not be the key"
    );
    // bob cannot see, make or revoke alice's keys: the same 404 as a tenant that is not there.
    for (m, uri) in [
        ("GET", "/v1/tenants/alice/keys"),
        ("POST", "/v1/tenants/alice/keys"),
        ("DELETE", "/v1/tenants/alice/keys/1"),
    ] {
        let (s, v) = call(m, uri, &tokens["bob"]);
        assert_eq!(s, 404, "{m} {uri}: {v}");
    }
    // An inference key is no API token: it cannot stop or destroy its tenant.
    let (s, _) = call("POST", "/v1/tenants/alice/stop", &key);
    assert_eq!(s, 401);
    let (s, _) = call("DELETE", "/v1/tenants/alice", &key);
    assert_eq!(s, 401);
    // Revoking a key that is not live is a clear 404; revoking one works once.
    let id = made["id"].as_i64().unwrap();
    assert_eq!(
        call("DELETE", "/v1/tenants/alice/keys/999", &tokens["alice"]).0,
        404
    );
    assert_eq!(
        call(
            "DELETE",
            &format!("/v1/tenants/alice/keys/{id}"),
            &tokens["alice"]
        )
        .0,
        200
    );
    assert_eq!(
        call(
            "DELETE",
            &format!("/v1/tenants/alice/keys/{id}"),
            &tokens["alice"]
        )
        .0,
        404
    );
    assert!(super::keys::authenticate(h.svc.store(), Some(&bearer)).is_err());

    // Departure revokes the rest, and the receipt says so.
    let (_, third) = call("POST", "/v1/tenants/alice/keys", &admin);
    let third = format!("Bearer {}", third["key"].as_str().unwrap());
    let alice_id = h.svc.store().tenant("alice").unwrap().unwrap().id;
    h.svc
        .execute(&Caller::Admin, TenantCommand::Destroy("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    assert!(super::keys::authenticate(h.svc.store(), Some(&third)).is_err());
    assert_eq!(h.svc.store().live_inference_keys(alice_id).unwrap(), 0);
    let kit = h.svc.departure_kit().unwrap();
    let receipt = kit
        .log
        .entries()
        .unwrap()
        .into_iter()
        .find(|e| e.receipt.tenant == "alice")
        .unwrap()
        .receipt;
    let route_off = receipt
        .steps
        .iter()
        .find(|s| s.step == crate::receipt::DepartureStep::GatewayRouteOff)
        .unwrap();
    let shown = serde_json::to_string(route_off).unwrap();
    assert!(
        shown.contains("2 inference key(s) revoked, none left live"),
        "{shown}"
    );
}

/// Everything the process logs from here on (all threads), for the no-prompt-in-logs test.
fn captured_log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: std::sync::OnceLock<Arc<Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("no other global subscriber");
        buf
    })
    .clone()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Files under `dir` (the state directory, store, logs, everything) holding `needle`.
fn files_holding(dir: &std::path::Path, needle: &[u8]) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            found.extend(files_holding(&p, needle));
        } else if std::fs::read(&p).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle)) {
            found.push(p);
        }
    }
    found
}

#[test]
fn no_prompt_or_completion_text_reaches_a_log_an_event_a_file_or_an_error() {
    let log = captured_log();
    let Some(d) = door(&[("alice", "max_request_bytes = 4096\nrequests_per_s = 1000")]) else {
        return;
    };
    let prompt = "secret-prompt-a41d07";
    // Answered, streamed, refused as too large, refused as malformed, refused by quota.
    let r = d.post(
        "/v1/completions",
        "alice",
        json!({"model": "alice-model", "prompt": prompt}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["choices"][0]["text"], COMPLETION_MARKER);
    let r = d.post(
        "/v1/chat/completions",
        "alice",
        json!({"model": "alice-model", "stream": true,
        "messages": [{"role": "user", "content": prompt}]}),
    );
    assert_eq!(r.status, 200);
    assert!(String::from_utf8(r.body()).unwrap().contains("[DONE]"));
    let mut errors = Vec::new();
    let r = d.post(
        "/v1/completions",
        "alice",
        json!({"model": "alice-model", "prompt": prompt.repeat(300)}),
    );
    assert_eq!(r.status, 413);
    errors.push(r.body());
    let r = d.send(
        "POST",
        "/v1/completions",
        Some(&d.keys["alice"]),
        Some(format!("{{\"prompt\": \"{prompt}\"").as_bytes()),
    );
    assert_eq!(r.status, 400);
    errors.push(r.body());
    let r = d.send(
        "POST",
        "/v1/completions",
        Some(prompt),
        Some(format!("{{\"prompt\": \"{prompt}\"}}").as_bytes()),
    );
    assert_eq!(r.status, 401);
    errors.push(r.body());
    for e in &errors {
        let e = String::from_utf8_lossy(e);
        assert!(!e.contains(prompt), "an error quotes the prompt: {e}");
    }
    // The log saw these requests (so the check below can fail), but not their text.
    let logged = String::from_utf8(log.lock().unwrap().clone()).unwrap();
    assert!(
        logged.contains("front door request") && logged.contains("alice"),
        "{logged}"
    );
    for marker in [prompt, COMPLETION_MARKER] {
        assert!(!logged.contains(marker), "the log holds {marker:?}");
        let holders = files_holding(d.h.dir.path(), marker.as_bytes());
        assert!(holders.is_empty(), "{marker:?} is in {holders:?}");
    }
    // Positive control for the file scan: a marker that is stored is found.
    let t = d.h.svc.store().tenant("alice").unwrap().unwrap();
    d.h.svc
        .store()
        .add_event(Some(t.id), "test", "control-marker-77ab")
        .unwrap();
    assert!(!files_holding(d.h.dir.path(), b"control-marker-77ab").is_empty());
}

#[test]
fn a_bad_certificate_or_key_is_a_clear_error_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (good_cert, good_key) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
    std::fs::write(&good_cert, cert.cert.pem()).unwrap();
    std::fs::write(&good_key, cert.key_pair.serialize_pem()).unwrap();
    assert!(super::tls_config(&good_cert, &good_key).is_ok());
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a pem file\n").unwrap();
    let missing = dir.path().join("missing.pem");
    for (c, k, what) in [
        (&missing, &good_key, "certificate"),
        (&empty, &good_key, "certificate"),
        (&good_cert, &garbage, "key"),
        (&good_cert, &missing, "key"),
        // A certificate given as the key.
        (&good_cert, &good_cert, "key"),
    ] {
        let e = super::tls_config(c, k).unwrap_err().to_string();
        assert!(e.contains(what) && e.contains("openssl req"), "{e}");
    }
}

#[test]
fn a_hostile_payload_breaks_only_its_own_answer_and_frees_its_place_at_once() {
    let Some(d) = door(&[
        ("alice", "max_concurrency = 1\nrequests_per_s = 1000"),
        ("bob", ""),
    ]) else {
        return;
    };
    for prompt in ["huge", "garbled"] {
        let started = Instant::now();
        // Whatever arrives before the connection is cut (the head and the first piece may or
        // may not have been written by then): never a complete answer, never the bad frame.
        let mut c = d.connect();
        let body = json!({"model": "alice-model", "prompt": prompt, "stream": true}).to_string();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            d.keys["alice"],
            body.len()
        )
        .unwrap();
        c.flush().unwrap();
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got);
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{prompt}: {:?}",
            started.elapsed()
        );
        let got = String::from_utf8_lossy(&got).to_string();
        assert!(
            !got.contains("[DONE]"),
            "{prompt}: a broken answer looked complete: {got}"
        );
        assert!(
            !got.contains("zzzz"),
            "{prompt}: the oversized frame was passed on"
        );
        assert!(
            got.is_empty() || got.starts_with("HTTP/1.1 200"),
            "{prompt}: the request did not reach the hostile guest: {got}"
        );
        assert!(
            !got.ends_with("0\r\n\r\n"),
            "{prompt}: the cut answer was ended as complete: {got}"
        );
        // alice's only place is free again, and bob was never held up.
        let r = d.post(
            "/v1/completions",
            "alice",
            json!({"model": "alice-model", "prompt": "x"}),
        );
        assert_eq!(r.status, 200, "{prompt}: alice's place was not freed");
        let r = d.post(
            "/v1/completions",
            "bob",
            json!({"model": "bob-model", "prompt": "x"}),
        );
        assert_eq!(r.status, 200);
    }
}

/// A kept-alive connection that has made one `GET /v1/models` with `key`; its status.
fn kept_alive(d: &Door, key: &str) -> (BufReader<Tls>, u16) {
    let mut s = d.connect();
    write!(
        s,
        "GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n\r\n"
    )
    .unwrap();
    s.flush().unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line.split(' ').nth(1).unwrap().parse().unwrap();
    let mut len = 0;
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        if line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).unwrap();
    (r, status)
}

#[test]
fn one_tenants_clients_cannot_hold_more_than_their_share_of_connections() {
    let Some(d) = door(&[("alice", "requests_per_s = 100000"), ("bob", "")]) else {
        return;
    };
    let mut held: Vec<_> = (0..super::MAX_TENANT_CONNECTIONS)
        .map(|_| {
            let (c, status) = kept_alive(&d, &d.keys["alice"]);
            assert_eq!(status, 200);
            c
        })
        .collect();
    let (_, status) = kept_alive(&d, &d.keys["alice"]);
    assert_eq!(status, 429, "alice opened more than her share");
    // bob is not affected, and one of alice's connections closing makes room for another.
    assert_eq!(kept_alive(&d, &d.keys["bob"]).1, 200);
    drop(held.pop());
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if kept_alive(&d, &d.keys["alice"]).1 == 200 {
            break;
        }
        assert!(
            Instant::now() < until,
            "a closed connection was never given back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
