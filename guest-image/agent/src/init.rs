//! What PID 1 does before anything else: the basic mounts, the console on fds 0-2, the
//! loopback interface (the payload listens on 127.0.0.1), and the final power-off.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{mount, MsFlags};
use thiserror::Error;

/// Why early setup failed.
#[derive(Debug, Error)]
pub enum InitError {
    /// A mount failed.
    #[error("Mounting {fstype} on {target} failed: {source}")]
    Mount {
        /// Mount point.
        target: String,
        /// File system type.
        fstype: String,
        /// Cause.
        source: Errno,
    },
    /// A directory could not be created.
    #[error("Creating {path} failed: {source}")]
    Mkdir {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The console could not be opened.
    #[error("Opening /dev/console failed: {0}")]
    Console(std::io::Error),
    /// Bringing up `lo` failed.
    #[error("Bringing up the loopback interface failed: {0}")]
    Loopback(std::io::Error),
}

/// Mounts /proc, /sys, /dev (devtmpfs), /run and /tmp. Already-mounted is fine.
pub fn mount_basics() -> Result<(), InitError> {
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let table: [(&str, &str, &str, MsFlags, Option<&str>); 5] = [
        ("proc", "/proc", "proc", nosuid, None),
        ("sysfs", "/sys", "sysfs", nosuid, None),
        (
            "devtmpfs",
            "/dev",
            "devtmpfs",
            MsFlags::MS_NOSUID,
            Some("mode=0755"),
        ),
        (
            "tmpfs",
            "/run",
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=0755"),
        ),
        (
            "tmpfs",
            "/tmp",
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=1777"),
        ),
    ];
    for (src, target, fstype, flags, data) in table {
        std::fs::create_dir_all(target).map_err(|source| InitError::Mkdir {
            path: target.to_string(),
            source,
        })?;
        match mount(Some(src), target, Some(fstype), flags, data) {
            Ok(()) | Err(Errno::EBUSY) => {}
            Err(source) => {
                return Err(InitError::Mount {
                    target: target.to_string(),
                    fstype: fstype.to_string(),
                    source,
                })
            }
        }
    }
    for dir in ["/run/cryptsetup", "/run/lock"] {
        std::fs::create_dir_all(dir).map_err(|source| InitError::Mkdir {
            path: dir.to_string(),
            source,
        })?;
    }
    Ok(())
}

/// Points stdin, stdout and stderr at /dev/console (the kernel may have started init
/// without them when the initramfs has no /dev/console node).
pub fn attach_console() -> Result<(), InitError> {
    let console = OpenOptions::new()
        .read(true)
        .write(true)
        .open(Path::new("/dev/console"))
        .map_err(InitError::Console)?;
    for fd in 0..3 {
        // SAFETY: dup2 on a valid open fd onto the standard descriptors; no Rust object
        // owns fds 0-2 in this process.
        if unsafe { libc::dup2(console.as_raw_fd(), fd) } < 0 {
            return Err(InitError::Console(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Sets IFF_UP on `lo`.
pub fn loopback_up() -> Result<(), InitError> {
    // SAFETY: creating a datagram socket has no memory effects; the fd is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(InitError::Loopback(std::io::Error::last_os_error()));
    }
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we own and pass by
    // pointer; the union member used is ifru_flags in both calls.
    let result = unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            if libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(())
            }
        }
    };
    // SAFETY: fd is ours and not used after this.
    unsafe { libc::close(fd) };
    result.map_err(InitError::Loopback)
}

/// Flushes file systems and powers the machine off. Returns only if the kernel refused.
pub fn power_off() -> std::io::Error {
    // SAFETY: sync(2) has no memory effects.
    unsafe { libc::sync() };
    // SAFETY: reboot(2) with RB_POWER_OFF ends the machine; it touches no memory of ours.
    unsafe { libc::reboot(libc::RB_POWER_OFF) };
    std::io::Error::last_os_error()
}
