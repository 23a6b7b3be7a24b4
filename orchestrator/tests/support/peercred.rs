//! For tests and benchmarks that stand in for a tenant's guest agent: a Unix socket
//! listened on as the tenant's uid, which is what the daemon's peer-credential check
//! (SO_PEERCRED) wants to see. Needs root (CAP_SETUID).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::Path;

/// Binds `path` as root, then listens with one thread's effective uid set to `uid`: Linux
/// records a listener's credentials at listen(2), and a client's SO_PEERCRED reports them.
/// Only that thread's credentials change (the raw system call, not glibc's process-wide
/// wrapper), and only for that call.
pub fn listen_as(path: &Path, uid: u32) -> std::io::Result<UnixListener> {
    use nix::sys::socket::{bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType};
    let fd: OwnedFd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    bind(fd.as_raw_fd(), &nix::sys::socket::UnixAddr::new(path)?)?;
    std::thread::scope(|s| {
        s.spawn(|| -> std::io::Result<()> {
            // SAFETY: the raw setresuid changes only the calling thread's effective uid;
            // -1 leaves the real and saved uids (root) as they are.
            if unsafe { libc::syscall(libc::SYS_setresuid, -1, uid, -1) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let listened = listen(&fd, Backlog::new(64).expect("a valid backlog"));
            // SAFETY: as above; the saved uid is still 0, so this restores root.
            let restored = unsafe { libc::syscall(libc::SYS_setresuid, -1, 0, -1) };
            assert_eq!(restored, 0, "cannot restore the thread's uid");
            listened.map_err(std::io::Error::from)
        })
        .join()
        .expect("the listening thread panicked")
    })?;
    Ok(UnixListener::from(fd))
}
