//! A vsock peer for the nested host's stock-kernel scenario, run inside a stock Linux guest
//! (built static: the guest's initramfs has no C library).
//!
//! ```text
//! nh-vsock-echo listen PORT           accept one connection on PORT, echo until EOF
//! nh-vsock-echo connect CID PORT TEXT connect to CID:PORT, send TEXT and a newline, print
//!                                     the line that comes back
//! ```
//! Exits 0 on success, 1 with a message on standard error otherwise.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::process::ExitCode;

fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn address(cid: u32, port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is plain old data; all-zero is a valid value before the fields
    // below are set.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    addr
}

fn socket() -> Result<OwnedFd, String> {
    // SAFETY: socket(2) with constant arguments; the result is checked before use.
    let fd: RawFd =
        unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(os_error("socket(AF_VSOCK)"));
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn listen(port: u32) -> Result<(), String> {
    let sock = socket()?;
    let addr = address(libc::VMADDR_CID_ANY, port);
    // SAFETY: addr is a valid sockaddr_vm and the length passed is its size.
    let rc = unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(os_error("bind"));
    }
    // SAFETY: listen(2) on a socket we own.
    if unsafe { libc::listen(sock.as_raw_fd(), 1) } != 0 {
        return Err(os_error("listen"));
    }
    println!("nh-vsock-echo: listening on port {port}");
    // SAFETY: accept(2) on a listening socket we own; the peer address is not wanted.
    let conn = unsafe {
        libc::accept4(
            sock.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if conn < 0 {
        return Err(os_error("accept"));
    }
    // SAFETY: conn is a fresh descriptor that nothing else owns.
    let mut stream = File::from(unsafe { OwnedFd::from_raw_fd(conn) });
    let mut buf = [0u8; 4096];
    let mut total = 0usize;
    loop {
        let n = stream.read(&mut buf).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            break;
        }
        stream
            .write_all(&buf[..n])
            .map_err(|e| format!("write: {e}"))?;
        total += n;
    }
    println!("nh-vsock-echo: echoed {total} bytes");
    Ok(())
}

fn connect(cid: u32, port: u32, text: &str) -> Result<(), String> {
    let sock = socket()?;
    let addr = address(cid, port);
    // SAFETY: addr is a valid sockaddr_vm and the length passed is its size.
    let rc = unsafe {
        libc::connect(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(os_error(&format!("connect to {cid}:{port}")));
    }
    let mut stream = File::from(sock);
    stream
        .write_all(format!("{text}\n").as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .map_err(|e| format!("read: {e}"))?;
    println!("nh-vsock-echo: got back {}", line.trim_end());
    Ok(())
}

fn number(s: Option<&String>, what: &str) -> Result<u32, String> {
    s.ok_or_else(|| format!("missing {what}"))?
        .parse()
        .map_err(|_| format!("{what} must be a number"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("listen") => number(args.get(1), "PORT").and_then(listen),
        Some("connect") => number(args.get(1), "CID").and_then(|cid| {
            let port = number(args.get(2), "PORT")?;
            let text = args.get(3).ok_or("missing TEXT")?;
            connect(cid, port, text)
        }),
        _ => Err("usage: nh-vsock-echo listen PORT | connect CID PORT TEXT".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nh-vsock-echo: {e}");
            ExitCode::FAILURE
        }
    }
}
