//! [`AgentClient::gpu_info`] against a fake agent on a socket pair: a sound reply, an older
//! agent, and hostile replies (over the caps, garbage, the wrong kind).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::thread;

use super::*;
use crate::frame::read_frame;
use crate::gpu::{GpuInfoReply, NvidiaSmi, PciFunction, MAX_PCI_DEVICES};
use crate::message::ErrorCode;

/// Answers one request on `s` with the JSON `outcome` (raw, so it may be anything).
fn fake_agent(mut s: UnixStream, outcome: serde_json::Value) -> Request {
    let body = read_frame(&mut s).unwrap();
    let req: RequestFrame = decode_body(&body).unwrap();
    let resp = serde_json::json!({ "id": req.id, "outcome": outcome });
    let json = serde_json::to_vec(&resp).unwrap();
    let mut frame = crate::frame::MAGIC.to_vec();
    frame.extend_from_slice(&crate::frame::PROTOCOL_VERSION.to_be_bytes());
    frame.extend_from_slice(&0u16.to_be_bytes());
    frame.extend_from_slice(&u32::try_from(json.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&json);
    s.write_all(&frame).unwrap();
    req.request
}

fn ask(outcome: serde_json::Value) -> (Result<GpuInfoReply, AgentClientError>, Request) {
    let (host, guest) = UnixStream::pair().unwrap();
    let agent = thread::spawn(move || fake_agent(guest, outcome));
    let mut c = AgentClient::over_stream(host);
    let r = c.gpu_info(Duration::from_secs(5));
    (r, agent.join().unwrap())
}

fn sound() -> GpuInfoReply {
    GpuInfoReply {
        pci: vec![PciFunction {
            address: "0000:00:05.0".into(),
            vendor: 0x1234,
            device: 0x11e8,
            subsystem_vendor: None,
            subsystem_device: None,
            class: 0x00ff00,
            driver: None,
        }],
        pci_truncated: false,
        pci_unreadable: 0,
        nvidia_smi: NvidiaSmi::Absent {
            searched: vec!["/usr/bin/nvidia-smi".into()],
        },
    }
}

fn ok(reply: &GpuInfoReply) -> serde_json::Value {
    let mut v = serde_json::to_value(reply).unwrap();
    v["reply"] = "gpu-info".into();
    serde_json::json!({ "ok": v })
}

#[test]
fn the_request_has_no_arguments_and_a_sound_reply_round_trips() {
    let (r, req) = ask(ok(&sound()));
    assert_eq!(req, Request::GpuInfo);
    assert_eq!(r.unwrap(), sound());
    assert_eq!(
        serde_json::to_string(&Request::GpuInfo).unwrap(),
        r#"{"cmd":"gpu-info"}"#
    );
    // Like `status`, a request without fields has nothing a sender could add: serde drops
    // extra keys of a unit variant, and what reaches the agent is the bare request.
    assert_eq!(
        serde_json::from_str::<Request>(r#"{"cmd":"gpu-info","command":"rm -rf /"}"#).unwrap(),
        Request::GpuInfo
    );
}

#[test]
fn an_older_agent_is_told_apart_from_a_failure() {
    // What an agent without gpu-info answers: its decoder's unknown-variant refusal.
    let (r, _) = ask(serde_json::json!({"err": {
        "code": ErrorCode::BadRequest,
        "message": "unknown variant `gpu-info`, expected one of `status`, `unlock-disk`"
    }}));
    let e = r.unwrap_err();
    assert!(
        matches!(e, AgentClientError::Unsupported { what: "gpu-info" }),
        "{e:?}"
    );
    assert!(e.to_string().contains("does not support gpu-info"), "{e}");
    let (r, _) = ask(serde_json::json!({"err": {"code": "internal", "message": "boom"}}));
    assert!(matches!(r, Err(AgentClientError::Agent { .. })), "{r:?}");
}

#[test]
fn hostile_replies_are_refused() {
    let mut big = sound();
    big.pci = vec![big.pci[0].clone(); MAX_PCI_DEVICES + 1];
    let (r, _) = ask(ok(&big));
    assert!(
        matches!(r, Err(AgentClientError::RefusedReply { .. })),
        "{r:?}"
    );
    let mut bad = sound();
    bad.pci[0].driver = Some("\u{1b}[2Jowned".into());
    let (r, _) = ask(ok(&bad));
    assert!(
        matches!(r, Err(AgentClientError::RefusedReply { .. })),
        "{r:?}"
    );
    for garbage in [
        serde_json::json!({"ok": {"reply": "gpu-info", "pci": "lots"}}),
        serde_json::json!({"ok": {"reply": "gpu-info", "pci": [], "pci_truncated": false,
            "pci_unreadable": 0, "nvidia_smi": {"state": "absent", "searched": []}, "x": 1}}),
        serde_json::json!({"ok": {"reply": "gpu-info", "pci": [{"address": "0000:00:05.0",
            "vendor": 70000, "device": 1, "subsystem_vendor": null,
            "subsystem_device": null, "class": 0, "driver": null}], "pci_truncated": false,
            "pci_unreadable": 0, "nvidia_smi": {"state": "absent", "searched": []}}}),
    ] {
        let (r, _) = ask(garbage);
        assert!(matches!(r, Err(AgentClientError::BadResponse(_))), "{r:?}");
    }
    let (r, _) = ask(serde_json::json!({"ok": {"reply": "model-ready"}}));
    assert!(
        matches!(
            r,
            Err(AgentClientError::UnexpectedReply { what: "gpu-info" })
        ),
        "{r:?}"
    );
}
