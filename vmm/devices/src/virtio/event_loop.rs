//! The device event loop: an event-manager on its own thread, where every virtio
//! device's handler runs. vCPU threads only add and remove handlers through a remote
//! endpoint; they never run device work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use event_manager::{EventManager, RemoteEndpoint, SubscriberId, SubscriberOps};

use super::DeviceSubscriber;

/// Why the event loop could not take or drop a handler.
#[derive(Debug, thiserror::Error)]
pub enum EventLoopError {
    /// The event manager refused the call (its thread is gone, or the id is unknown).
    #[error("Device event loop call failed: {0}")]
    Manager(#[from] event_manager::Error),
    /// The thread could not be started.
    #[error("Could not start the device event loop thread: {0}")]
    Spawn(std::io::Error),
    /// The event manager could not be created on the thread.
    #[error("Could not create the device event manager")]
    Create,
    /// The thread's start-up hook failed (its seccomp filter, say); the loop never ran.
    #[error("The device event loop thread could not be prepared: {0}")]
    Init(String),
}

/// Work a new thread does on itself before it serves anything (installing its seccomp
/// filter, say). An error stops the thread before it handles any guest input.
pub type ThreadInit = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// Where the transport puts activated devices' handlers. The VMM implements this with
/// its device thread; [`EventLoopThread`] is a ready implementation.
pub trait DeviceEventLoop: Send + Sync {
    /// Registers a handler; its `init` runs on the loop thread.
    fn add(&self, subscriber: DeviceSubscriber) -> Result<SubscriberId, EventLoopError>;
    /// Unregisters a handler (all its file descriptors leave the epoll set).
    fn remove(&self, id: SubscriberId) -> Result<(), EventLoopError>;
}

impl DeviceEventLoop for RemoteEndpoint<DeviceSubscriber> {
    fn add(&self, subscriber: DeviceSubscriber) -> Result<SubscriberId, EventLoopError> {
        self.call_blocking(
            move |ops: &mut dyn SubscriberOps<Subscriber = DeviceSubscriber>| {
                Ok::<_, EventLoopError>(ops.add_subscriber(subscriber))
            },
        )
    }

    fn remove(&self, id: SubscriberId) -> Result<(), EventLoopError> {
        self.call_blocking(
            move |ops: &mut dyn SubscriberOps<Subscriber = DeviceSubscriber>| {
                ops.remove_subscriber(id)
                    .map(drop)
                    .map_err(EventLoopError::from)
            },
        )
    }
}

/// An event manager running on a thread named `name`; stopped and joined on drop.
pub struct EventLoopThread {
    endpoint: RemoteEndpoint<DeviceSubscriber>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EventLoopThread {
    /// Starts the loop.
    pub fn spawn(name: &str) -> Result<Self, EventLoopError> {
        Self::spawn_with(name, None)
    }

    /// Starts the loop; `init` runs on its thread once the event manager exists and
    /// before the first event is served.
    pub fn spawn_with(name: &str, init: Option<ThreadInit>) -> Result<Self, EventLoopError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let thread_stop = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let mut manager = match EventManager::<DeviceSubscriber>::new() {
                    Ok(manager) => manager,
                    Err(e) => {
                        tracing::error!("Device event manager: {e}");
                        return;
                    }
                };
                if let Some(Err(e)) = init.map(|init| init()) {
                    let _ = tx.send(Err(e));
                    return;
                }
                if tx.send(Ok(manager.remote_endpoint())).is_err() {
                    return;
                }
                while !thread_stop.load(Ordering::Acquire) {
                    if let Err(e) = manager.run() {
                        tracing::error!("Device event loop stopped: {e}");
                        break;
                    }
                }
            })
            .map_err(EventLoopError::Spawn)?;
        let endpoint = rx
            .recv()
            .map_err(|_| EventLoopError::Create)?
            .map_err(EventLoopError::Init)?;
        Ok(Self {
            endpoint,
            stop,
            thread: Some(thread),
        })
    }

    /// The endpoint other threads use to reach the loop.
    pub fn endpoint(&self) -> RemoteEndpoint<DeviceSubscriber> {
        self.endpoint.clone()
    }
}

impl DeviceEventLoop for EventLoopThread {
    fn add(&self, subscriber: DeviceSubscriber) -> Result<SubscriberId, EventLoopError> {
        self.endpoint.add(subscriber)
    }

    fn remove(&self, id: SubscriberId) -> Result<(), EventLoopError> {
        self.endpoint.remove(id)
    }
}

impl Drop for EventLoopThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.endpoint.kick();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use event_manager::{EventOps, Events, MutEventSubscriber};
    use std::sync::Mutex;
    use vmm_sys_util::epoll::EventSet;
    use vmm_sys_util::eventfd::EventFd;

    struct Counter {
        fd: EventFd,
        seen: Arc<std::sync::atomic::AtomicU64>,
    }

    impl MutEventSubscriber for Counter {
        fn process(&mut self, _events: Events, _ops: &mut EventOps) {
            let _ = self.fd.read();
            self.seen.fetch_add(1, Ordering::SeqCst);
        }
        fn init(&mut self, ops: &mut EventOps) {
            ops.add(Events::new(&self.fd, EventSet::IN)).unwrap();
        }
    }

    #[test]
    fn handler_runs_on_loop_thread_until_removed() {
        let lp = EventLoopThread::spawn("test-dev").unwrap();
        let fd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let sub: DeviceSubscriber = Arc::new(Mutex::new(Counter {
            fd: fd.try_clone().unwrap(),
            seen: seen.clone(),
        }));
        let id = lp.add(sub).unwrap();
        fd.write(1).unwrap();
        crate::test_utils::wait_until("the handler", || seen.load(Ordering::SeqCst) > 0);
        lp.remove(id).unwrap();
        assert!(lp.remove(id).is_err());
    }
}
