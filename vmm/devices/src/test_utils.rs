//! Fakes for tests: named as fakes, never used by the VMM.

use std::sync::Mutex;

use vmm_sys_util::eventfd::EventFd;

use crate::pci::{MsiInterruptSink, MsiMessage, MsiSinkError};

/// A fake [`MsiInterruptSink`]: one EventFd per vector (as KVM irqfds would be), and a
/// record of every route update and trigger.
pub struct FakeMsiSink {
    eventfds: Vec<EventFd>,
    routes: Mutex<Vec<Option<(MsiMessage, bool)>>>,
    triggered: Mutex<Vec<(u16, MsiMessage)>>,
}

impl FakeMsiSink {
    /// A sink for `vectors` vectors.
    pub fn new(vectors: u16) -> Self {
        Self {
            eventfds: (0..vectors)
                .map(|_| EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"))
                .collect(),
            routes: Mutex::new(vec![None; usize::from(vectors)]),
            triggered: Mutex::new(Vec::new()),
        }
    }

    /// Every trigger so far, in order.
    pub fn triggered(&self) -> Vec<(u16, MsiMessage)> {
        self.triggered.lock().unwrap().clone()
    }

    /// The last route pushed for `vector`: message and masked state.
    pub fn route(&self, vector: u16) -> Option<(MsiMessage, bool)> {
        self.routes
            .lock()
            .unwrap()
            .get(usize::from(vector))
            .copied()
            .flatten()
    }

    /// Clones of the per-vector EventFds (what a VMM would hand a VFIO device as irqfds).
    pub fn clone_eventfds(&self) -> Vec<EventFd> {
        self.eventfds
            .iter()
            .map(|e| e.try_clone().expect("clone eventfd"))
            .collect()
    }

    /// Reads (and resets) the EventFd counter of `vector`; 0 when nothing fired.
    pub fn eventfd_count(&self, vector: u16) -> u64 {
        self.eventfds
            .get(usize::from(vector))
            .and_then(|e| e.read().ok())
            .unwrap_or(0)
    }
}

impl MsiInterruptSink for FakeMsiSink {
    fn update(&self, vector: u16, message: MsiMessage, masked: bool) -> Result<(), MsiSinkError> {
        let mut routes = self.routes.lock().unwrap();
        let slot = routes
            .get_mut(usize::from(vector))
            .ok_or(MsiSinkError::Route {
                vector,
                reason: "no such vector in the fake".into(),
            })?;
        *slot = Some((message, masked));
        Ok(())
    }

    fn trigger(&self, vector: u16, message: MsiMessage) -> Result<(), MsiSinkError> {
        let fd = self
            .eventfds
            .get(usize::from(vector))
            .ok_or(MsiSinkError::Trigger {
                vector,
                reason: "no such vector in the fake".into(),
            })?;
        fd.write(1).map_err(|e| MsiSinkError::Trigger {
            vector,
            reason: e.to_string(),
        })?;
        self.triggered.lock().unwrap().push((vector, message));
        Ok(())
    }
}

/// Waits until `cond` holds, for at most 10 s (a failure guard, not a timing assertion).
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// A fake [`VirtioInterrupt`](crate::virtio::VirtioInterrupt) that records what the
/// device raised.
#[derive(Default)]
pub struct FakeInterrupt {
    raised: Mutex<Vec<crate::virtio::VirtioInterruptType>>,
    needs_reset: std::sync::atomic::AtomicBool,
}

impl FakeInterrupt {
    /// Everything raised so far.
    pub fn raised(&self) -> Vec<crate::virtio::VirtioInterruptType> {
        self.raised.lock().unwrap().clone()
    }

    /// Whether the device asked for a reset.
    pub fn needs_reset(&self) -> bool {
        self.needs_reset.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl crate::virtio::VirtioInterrupt for FakeInterrupt {
    fn trigger(
        &self,
        kind: crate::virtio::VirtioInterruptType,
    ) -> Result<(), crate::virtio::VirtioInterruptError> {
        self.raised.lock().unwrap().push(kind);
        Ok(())
    }

    fn signal_needs_reset(&self) {
        self.needs_reset
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}
