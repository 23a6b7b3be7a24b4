//! Socket files for tests of stale-socket handling.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Leaves a Unix stream socket file at `path` that nobody listens on, as a process killed
/// mid-run does. The socket is bound but never listens, so connecting to it is refused
/// whoever holds a copy of its fd. A closed `UnixListener` is no substitute in a test
/// binary: any test that forks holds a copy of every fd until its exec, and the "closed"
/// listener goes on accepting meanwhile.
///
/// # Panics
/// When the socket cannot be created or bound (the path is too long or its directory is
/// missing): a broken test setup.
pub fn stale_unix_socket(path: &Path) {
    // SAFETY: socket() takes no pointers; the fd it returns is closed below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    assert!(bytes.len() < addr.sun_path.len(), "socket path too long");
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: addr is a valid sockaddr_un that outlives the call, and len is its size.
    let rc = unsafe { libc::bind(fd, std::ptr::addr_of!(addr).cast(), len) };
    let err = std::io::Error::last_os_error();
    // SAFETY: fd is ours and closed exactly once.
    unsafe { libc::close(fd) };
    assert_eq!(rc, 0, "bind {}: {err}", path.display());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;
    use std::os::unix::net::UnixStream;

    #[test]
    fn the_socket_file_exists_and_refuses_connections() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stale.sock");
        stale_unix_socket(&path);
        assert!(path.exists());
        let err = UnixStream::connect(&path).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    }
}
