//! MSI-X delivery through KVM: one GSI and one irqfd per vector, the GSI's route pointed
//! at the vector's MSI message with KVM_SET_GSI_ROUTING.
//!
//! KVM_SET_GSI_ROUTING replaces the whole table, so [`GsiRouting`] keeps every route
//! (the default PIC and I/O APIC routes of the legacy IRQs included) and installs the
//! full table on each change.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use kvm_bindings::{
    kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};
use tenantvm_devices::pci::{MsiInterruptSink, MsiMessage, MsiSinkError};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::vstate::vm::Vm;

/// Pins of the in-kernel I/O APIC; GSIs below this are the legacy routes.
const IOAPIC_PINS: u32 = 24;
/// Pins of the two in-kernel 8259 PICs.
const PIC_PINS: u32 = 16;
/// Most GSIs KVM accepts in a routing table (KVM_MAX_IRQ_ROUTES is 4096).
const MAX_GSI: u32 = 4096;

/// Why an MSI route or irqfd could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum MsiRoutingError {
    /// Every GSI KVM offers is in use.
    #[error("No free GSI for an MSI-X vector (KVM allows {MAX_GSI}); use fewer devices")]
    Exhausted,
    /// KVM refused the routing table.
    #[error("KVM refused the interrupt routing table: {0}")]
    SetRouting(#[source] kvm_ioctls::Error),
    /// The routing table could not be built.
    #[error("Cannot build the interrupt routing table: {0}")]
    Table(String),
    /// An irqfd could not be created or registered.
    #[error("Cannot create or register an MSI-X irqfd: {0}")]
    Irqfd(#[source] std::io::Error),
}

#[derive(Default)]
struct RoutingState {
    /// Installed routes by GSI (several entries per GSI for the legacy IRQs 0-15).
    routes: BTreeMap<u32, Vec<kvm_irq_routing_entry>>,
    next_gsi: u32,
}

/// The VM's GSI routing table.
pub struct GsiRouting {
    vm: Arc<Vm>,
    state: Mutex<RoutingState>,
}

fn irqchip_route(gsi: u32, chip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut entry = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_IRQCHIP,
        ..Default::default()
    };
    entry.u.irqchip.irqchip = chip;
    entry.u.irqchip.pin = pin;
    entry
}

fn msi_route(gsi: u32, message: MsiMessage) -> kvm_irq_routing_entry {
    let mut entry = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_MSI,
        ..Default::default()
    };
    entry.u.msi.address_lo = message.address as u32;
    entry.u.msi.address_hi = (message.address >> 32) as u32;
    entry.u.msi.data = message.data;
    entry
}

/// The routes KVM installs by itself for the in-kernel irqchip (kvm_setup_default_irq_routing):
/// GSIs 0-15 to both PICs and the I/O APIC, 16-23 to the I/O APIC.
fn default_routes() -> BTreeMap<u32, Vec<kvm_irq_routing_entry>> {
    (0..IOAPIC_PINS)
        .map(|gsi| {
            let mut routes = vec![irqchip_route(gsi, KVM_IRQCHIP_IOAPIC, gsi)];
            if gsi < PIC_PINS {
                let (chip, pin) = if gsi < 8 {
                    (KVM_IRQCHIP_PIC_MASTER, gsi)
                } else {
                    (KVM_IRQCHIP_PIC_SLAVE, gsi - 8)
                };
                routes.push(irqchip_route(gsi, chip, pin));
            }
            (gsi, routes)
        })
        .collect()
}

impl GsiRouting {
    /// Starts from KVM's default legacy routes (nothing is installed until a change).
    pub fn new(vm: Arc<Vm>) -> Self {
        Self {
            vm,
            state: Mutex::new(RoutingState {
                routes: default_routes(),
                next_gsi: IOAPIC_PINS,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RoutingState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The VM the routes belong to.
    pub fn vm(&self) -> &Arc<Vm> {
        &self.vm
    }

    /// Reserves a GSI for an MSI vector (no route until [`GsiRouting::set_msi`]).
    pub fn allocate(&self) -> Result<u32, MsiRoutingError> {
        let mut state = self.lock();
        if state.next_gsi >= MAX_GSI {
            return Err(MsiRoutingError::Exhausted);
        }
        state.next_gsi += 1;
        Ok(state.next_gsi - 1)
    }

    /// Points `gsi` at `message`, or removes its route (`None`), and installs the table.
    pub fn set_msi(&self, gsi: u32, message: Option<MsiMessage>) -> Result<(), MsiRoutingError> {
        let mut state = self.lock();
        let previous = match message {
            Some(message) => state.routes.insert(gsi, vec![msi_route(gsi, message)]),
            None => state.routes.remove(&gsi),
        };
        let result = self.install(&state.routes);
        if result.is_err() {
            // Keep our copy equal to what KVM has.
            match previous {
                Some(routes) => state.routes.insert(gsi, routes),
                None => state.routes.remove(&gsi),
            };
        }
        result
    }

    fn install(
        &self,
        routes: &BTreeMap<u32, Vec<kvm_irq_routing_entry>>,
    ) -> Result<(), MsiRoutingError> {
        let entries: Vec<_> = routes.values().flatten().copied().collect();
        let mut table = KvmIrqRouting::new(entries.len())
            .map_err(|e| MsiRoutingError::Table(format!("{e:?}")))?;
        table.as_mut_slice().copy_from_slice(&entries);
        self.vm
            .fd()
            .set_gsi_routing(&table)
            .map_err(MsiRoutingError::SetRouting)
    }

    /// The number of routes installed (tests).
    pub fn route_count(&self) -> usize {
        self.lock().routes.values().map(Vec::len).sum()
    }
}

/// One PCI function's MSI-X vectors: a GSI and an irqfd each.
pub struct KvmMsiSink {
    routing: Arc<GsiRouting>,
    vectors: Vec<(u32, EventFd)>,
}

impl KvmMsiSink {
    /// Allocates `vectors` GSIs and registers an irqfd on each.
    pub fn new(routing: Arc<GsiRouting>, vectors: u16) -> Result<Self, MsiRoutingError> {
        let mut list = Vec::with_capacity(usize::from(vectors));
        for _ in 0..vectors {
            let gsi = routing.allocate()?;
            let irqfd = EventFd::new(EFD_NONBLOCK).map_err(MsiRoutingError::Irqfd)?;
            routing
                .vm
                .fd()
                .register_irqfd(&irqfd, gsi)
                .map_err(|e| MsiRoutingError::Irqfd(e.into()))?;
            list.push((gsi, irqfd));
        }
        Ok(Self {
            routing,
            vectors: list,
        })
    }

    /// The GSI of `vector`.
    pub fn gsi(&self, vector: u16) -> Option<u32> {
        self.vectors.get(usize::from(vector)).map(|(gsi, _)| *gsi)
    }
}

impl MsiInterruptSink for KvmMsiSink {
    fn update(&self, vector: u16, message: MsiMessage, masked: bool) -> Result<(), MsiSinkError> {
        let (gsi, _) = self
            .vectors
            .get(usize::from(vector))
            .ok_or(MsiSinkError::Route {
                vector,
                reason: "no such vector".into(),
            })?;
        // A masked vector has no route, so nothing stale can be delivered; the device
        // model keeps its pending bit and triggers again on unmask.
        let route = (!masked).then_some(message);
        self.routing
            .set_msi(*gsi, route)
            .map_err(|e| MsiSinkError::Route {
                vector,
                reason: e.to_string(),
            })
    }

    fn trigger(&self, vector: u16, _message: MsiMessage) -> Result<(), MsiSinkError> {
        let (_, irqfd) = self
            .vectors
            .get(usize::from(vector))
            .ok_or(MsiSinkError::Trigger {
                vector,
                reason: "no such vector".into(),
            })?;
        irqfd.write(1).map_err(|e| MsiSinkError::Trigger {
            vector,
            reason: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm() -> Option<Arc<Vm>> {
        if !std::path::Path::new("/dev/kvm").exists() {
            tenantvm_skip::record_skip!("/dev/kvm is absent");
            return None;
        }
        let mem = vm_memory::GuestMemoryMmap::from_ranges(&[(vm_memory::GuestAddress(0), 1 << 20)])
            .expect("map 1 MiB of guest memory");
        Some(Arc::new(Vm::new(&mem).expect("create a VM")))
    }

    #[test]
    fn default_routes_cover_pic_and_ioapic_pins() {
        let routes = default_routes();
        assert_eq!(routes.len(), 24);
        assert_eq!(routes[&4].len(), 2);
        assert_eq!(routes[&20].len(), 1);
        // SAFETY: irqchip is the active member of these entries (type_ IRQCHIP).
        let pin = unsafe { routes[&10][1].u.irqchip };
        assert_eq!((pin.irqchip, pin.pin), (KVM_IRQCHIP_PIC_SLAVE, 2));
    }

    #[test]
    fn msi_routes_install_and_masked_vectors_lose_their_route() {
        let Some(vm) = vm() else { return };
        let routing = Arc::new(GsiRouting::new(vm));
        let base = routing.route_count();
        let sink = KvmMsiSink::new(routing.clone(), 3).unwrap();
        assert_eq!(sink.gsi(0), Some(24));
        assert_eq!(sink.gsi(3), None);
        let msg = MsiMessage {
            address: 0xfee0_0000,
            data: 0x31,
        };
        sink.update(1, msg, false).unwrap();
        assert_eq!(routing.route_count(), base + 1);
        sink.update(1, msg, true).unwrap();
        assert_eq!(routing.route_count(), base);
        sink.trigger(2, msg).unwrap();
        assert!(sink.update(7, msg, false).is_err());
        assert!(sink.trigger(7, msg).is_err());
    }

    #[test]
    fn gsis_run_out_with_a_clear_error() {
        let Some(vm) = vm() else { return };
        let routing = GsiRouting::new(vm);
        let mut last = Ok(0);
        for _ in 0..MAX_GSI {
            last = routing.allocate();
            if last.is_err() {
                break;
            }
        }
        let err = last.unwrap_err().to_string();
        assert!(err.contains("No free GSI"), "{err}");
    }
}
