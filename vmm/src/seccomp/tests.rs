//! Each filter runs in a forked child that installs it and makes one system call: an
//! allowed call returns, a forbidden one ends the child with EXIT_SECCOMP through the
//! SIGSYS handler.

use super::*;

/// Forks; the child installs `kind`'s filter from `filters` and runs `call`, then exits
/// 0. Returns the child's exit status.
fn in_child(filters: &Filters, kind: ThreadKind, call: impl FnOnce()) -> i32 {
    install_sigsys_handler().unwrap();
    // SAFETY: the child only makes raw system calls and exits; it never returns into
    // the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        if filters.apply(kind).is_err() {
            // SAFETY: leaving the child.
            unsafe { libc::_exit(99) };
        }
        call();
        // SAFETY: leaving the child.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child died by signal: {status:#x}");
    libc::WEXITSTATUS(status)
}

fn filters() -> Filters {
    Filters::build(SeccompMode::On).unwrap().unwrap()
}

fn open_dev_null() {
    // SAFETY: a plain openat with a NUL-terminated path; the result is ignored.
    unsafe {
        libc::syscall(
            libc::SYS_openat,
            libc::AT_FDCWD,
            c"/dev/null".as_ptr(),
            libc::O_RDONLY,
        )
    };
}

fn socket(domain: i32) {
    // SAFETY: socket(2) with constant arguments; the descriptor is leaked to _exit.
    unsafe { libc::syscall(libc::SYS_socket, domain, libc::SOCK_STREAM, 0) };
}

fn mmap(prot: i32) {
    // SAFETY: an anonymous private mapping, left to _exit.
    unsafe {
        libc::syscall(
            libc::SYS_mmap,
            0usize,
            4096usize,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
}

fn ioctl(request: u64) {
    let mut buf = [0u8; 256];
    // SAFETY: an ioctl on stdin with a scratch buffer large enough for termios; errors
    // (ENOTTY, EBADF) are fine, only the filter's verdict matters.
    unsafe { libc::syscall(libc::SYS_ioctl, 0, request, buf.as_mut_ptr()) };
}

#[test]
fn every_kind_allows_plain_work_and_refuses_opening_files() {
    let f = filters();
    for kind in [
        ThreadKind::Main,
        ThreadKind::Vcpu,
        ThreadKind::Device,
        ThreadKind::SerialInput,
        ThreadKind::SerialOutput,
    ] {
        let ok = in_child(&f, kind, || {
            // SAFETY: getpid and a write of zero bytes to stderr have no effect.
            unsafe {
                libc::syscall(libc::SYS_getpid);
                libc::syscall(libc::SYS_write, 2, [0u8; 1].as_ptr(), 0);
            }
            mmap(libc::PROT_READ | libc::PROT_WRITE);
        });
        assert_eq!(ok, 0, "{kind:?}: allowed calls");
        assert_eq!(
            in_child(&f, kind, open_dev_null),
            EXIT_SECCOMP,
            "{kind:?}: openat"
        );
        assert_eq!(
            in_child(&f, kind, || mmap(libc::PROT_READ | libc::PROT_EXEC)),
            EXIT_SECCOMP,
            "{kind:?}: executable memory"
        );
    }
}

#[test]
fn only_the_device_thread_opens_sockets_and_only_unix_ones() {
    let f = filters();
    assert_eq!(
        in_child(&f, ThreadKind::Device, || socket(libc::AF_UNIX)),
        0
    );
    assert_eq!(
        in_child(&f, ThreadKind::Device, || socket(libc::AF_INET)),
        EXIT_SECCOMP
    );
    assert_eq!(
        in_child(&f, ThreadKind::Vcpu, || socket(libc::AF_UNIX)),
        EXIT_SECCOMP
    );
}

#[test]
fn ioctls_are_limited_to_each_kinds_requests() {
    let f = filters();
    // The vCPU may run KVM but not touch a terminal; the main thread the reverse.
    assert_eq!(in_child(&f, ThreadKind::Vcpu, || ioctl(KVM_RUN)), 0);
    assert_eq!(
        in_child(&f, ThreadKind::Vcpu, || ioctl(libc::TCGETS)),
        EXIT_SECCOMP
    );
    assert_eq!(in_child(&f, ThreadKind::Main, || ioctl(libc::TCGETS)), 0);
    assert_eq!(
        in_child(&f, ThreadKind::Main, || ioctl(KVM_RUN)),
        EXIT_SECCOMP
    );
    // KVM_CREATE_VM (_IO(KVMIO, 1)) is nobody's business once the VM runs.
    assert_eq!(
        in_child(&f, ThreadKind::Vcpu, || ioctl(0xae01)),
        EXIT_SECCOMP
    );
}

#[test]
fn log_mode_lets_calls_through_and_off_builds_nothing() {
    let logged = Filters::build(SeccompMode::Log).unwrap().unwrap();
    assert_eq!(in_child(&logged, ThreadKind::Vcpu, open_dev_null), 0);
    assert!(Filters::build(SeccompMode::Off).unwrap().is_none());
}

#[test]
fn kvm_request_numbers_match_the_kernel_headers() {
    // Values from linux/kvm.h on x86_64.
    assert_eq!(KVM_IRQFD, 0x4020_ae76);
    assert_eq!(KVM_IOEVENTFD, 0x4040_ae79);
    assert_eq!(KVM_SET_GSI_ROUTING, 0x4008_ae6a);
    assert_eq!(KVM_SIGNAL_MSI, 0x4020_aea5);
}

#[test]
fn decimal_formats_without_allocating() {
    let mut buf = [0u8; 20];
    assert_eq!(decimal(0, &mut buf), b"0");
    assert_eq!(decimal(59, &mut buf), b"59");
    assert_eq!(decimal(u64::MAX, &mut buf), b"18446744073709551615");
}

#[test]
fn vfio_and_exit_report_extras_open_exactly_their_calls() {
    let base = filters();
    let extra = Filters::build_for(
        SeccompMode::On,
        FilterExtras {
            vfio: true,
            exit_report: true,
        },
    )
    .unwrap()
    .unwrap();
    let pread = || {
        let mut b = [0u8; 1];
        // SAFETY: pread64 on stdin into a local buffer; errors are fine.
        unsafe { libc::syscall(libc::SYS_pread64, 0, b.as_mut_ptr(), 1usize, 0i64) };
    };
    let rename = || {
        // SAFETY: rename of two paths that do not exist; ENOENT is fine.
        unsafe {
            libc::syscall(
                libc::SYS_rename,
                c"/nonexistent/a".as_ptr(),
                c"/nonexistent/b".as_ptr(),
            )
        };
    };
    // Without passthrough no thread but the device thread preads, and nobody resets.
    assert_eq!(in_child(&base, ThreadKind::Vcpu, pread), EXIT_SECCOMP);
    assert_eq!(in_child(&extra, ThreadKind::Vcpu, pread), 0);
    assert_eq!(
        in_child(&base, ThreadKind::Main, || ioctl(VFIO_DEVICE_RESET)),
        EXIT_SECCOMP
    );
    assert_eq!(
        in_child(&extra, ThreadKind::Main, || ioctl(VFIO_DEVICE_RESET)),
        0
    );
    assert_eq!(
        in_child(&extra, ThreadKind::Vcpu, || ioctl(VFIO_DEVICE_SET_IRQS)),
        0
    );
    assert_eq!(
        in_child(&extra, ThreadKind::Vcpu, || ioctl(
            KVM_SET_USER_MEMORY_REGION
        )),
        0
    );
    // A vCPU never resets a device; the device thread gets nothing VFIO at all.
    assert_eq!(
        in_child(&extra, ThreadKind::Vcpu, || ioctl(VFIO_DEVICE_RESET)),
        EXIT_SECCOMP
    );
    assert_eq!(
        in_child(&extra, ThreadKind::Device, || ioctl(VFIO_DEVICE_SET_IRQS)),
        EXIT_SECCOMP
    );
    assert_eq!(in_child(&base, ThreadKind::Main, rename), EXIT_SECCOMP);
    assert_eq!(in_child(&extra, ThreadKind::Main, rename), 0);
    assert_eq!(KVM_SET_USER_MEMORY_REGION, 0x4020_ae46);
}

#[test]
fn no_thread_may_issue_iommufd_ioctls() {
    // The iommufd path (IOAS alloc and map, bind, attach) runs while the VM is set up,
    // before any filter is installed; at run time a cdev-opened device needs only the
    // VFIO device ioctls the legacy path uses (the same numbers). So no filter, even with
    // passthrough, lets a thread change the DMA address space.
    let extra = Filters::build_for(
        SeccompMode::On,
        FilterExtras {
            vfio: true,
            exit_report: true,
        },
    )
    .unwrap()
    .unwrap();
    for kind in [
        ThreadKind::Main,
        ThreadKind::Vcpu,
        ThreadKind::Device,
        ThreadKind::SerialInput,
        ThreadKind::SerialOutput,
    ] {
        for request in tenantvm_devices::pci::vfio::IOMMUFD_IOCTLS {
            assert_eq!(
                in_child(&extra, kind, || ioctl(request)),
                EXIT_SECCOMP,
                "{kind:?} may issue {request:#x}"
            );
        }
    }
}
