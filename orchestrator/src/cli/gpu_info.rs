//! `tenantvm gpu-info NAME`: the guest's view of its GPU beside the daemon's assignment
//! (`GET /v1/tenants/{name}/gpu`), as a table or JSON; exit 16 on a mismatch.

use std::io::Write;

use clap::Args;

use super::{exit, fail, output, CliFailure};
use crate::api::gpu_info::GpuInfoView;
use crate::client::Client;
use crate::gpu::guest_view::{FindingLevel, MEMORY_TOLERANCE_PERCENT};
use crate::untrusted::one_line;
use tenantvm_agent_protocol::NvidiaSmi;

/// Show the GPU a tenant's guest reports next to the share the daemon assigned to it.
///
/// Asks the tenant's guest agent (`gpu-info`) for the PCI functions the guest kernel
/// enumerated and, where the guest image has `nvidia-smi`, the GPUs the NVIDIA driver sees
/// (index, name, UUID, memory total and used, MIG mode; run in the guest with a 20 s
/// deadline). Prints them beside the assignment: the card, the placement (`whole` or
/// `<profile>@<start>`), the route (whole-gpu, sriov-vgpu, mdev-vgpu, not-attached), the
/// slice's memory and the host devices handed to the VM (PCI addresses on the host; the
/// guest numbers its own).
///
/// Then compares them and flags a MISMATCH when:
///   - a device was handed over and the guest shows no PCI function with its ids (a whole
///     card: the host device's vendor:device; a vGPU: an NVIDIA display-class function);
///   - nvidia-smi lists other than one GPU for a slice, or any GPU without one;
///   - nvidia-smi's memory.total is more than 5 % away from the slice's memory (the MIG
///     profile's NVML memory size, or the whole card's total);
///   - nvidia-smi fails or hangs where a GPU was handed over.
///
/// An image without nvidia-smi, a simulated GPU host (nothing is handed to the VM) and a
/// tenant without a GPU share are NOTEs, not mismatches.
///
/// The guest's answer is the tenant's: it is bounded and checked by the daemon and printed
/// with control characters escaped.
///
/// Token: the admin's or the tenant's own. The tenant must be running a guest image.
///
/// Examples:
///   tenantvm gpu-info alice
///   tenantvm gpu-info alice --json | jq '.guest.nvidia_smi'
///
/// Exit statuses: 0 the guest's view matches, 16 a mismatch (listed), 6 the tenant is not
/// running, runs no guest image, or its agent predates gpu-info (rebuild the image), 9 the
/// guest did not answer or answered outside the protocol's caps; the others as for every
/// command (`tenantvm --help`).
#[derive(Debug, Args)]
#[command(verbatim_doc_comment)]
pub struct GpuInfoArgs {
    /// Tenant name.
    pub name: String,
    /// Print the daemon's answer as JSON (assigned, guest, findings, matches).
    #[arg(long)]
    pub json: bool,
}

fn hex16(v: Option<u16>) -> String {
    v.map_or("-".into(), |v| format!("{v:04x}"))
}

fn mib(v: Option<u64>) -> String {
    v.map_or("-".into(), |v| format!("{v} MiB"))
}

/// Prints the view as text: the assignment, the guest's PCI functions, nvidia-smi's rows,
/// the findings.
pub(super) fn print_view(out: &mut dyn Write, v: &GpuInfoView) -> std::io::Result<()> {
    writeln!(out, "tenant:     {}", one_line(&v.tenant))?;
    writeln!(out, "ASSIGNED (daemon)")?;
    match &v.assigned {
        None => writeln!(out, "  none: the tenant has no GPU share")?,
        Some(a) => {
            writeln!(out, "  gpu:          {}", one_line(&a.gpu))?;
            if let Some(m) = &a.model {
                writeln!(out, "  model:        {}", one_line(m))?;
            }
            writeln!(
                out,
                "  slice:        {}{}",
                one_line(&a.label),
                a.mig_profile
                    .as_ref()
                    .map_or(" (whole card)".to_string(), |p| format!(
                        " (MIG {})",
                        one_line(p)
                    ))
            )?;
            writeln!(out, "  memory:       {}", mib(a.memory_mib))?;
            writeln!(out, "  route:        {}", one_line(&a.route))?;
            if let Some(why) = &a.not_attached {
                writeln!(out, "  not attached: {}", one_line(why))?;
            }
            if !a.host_devices.is_empty() {
                writeln!(
                    out,
                    "  host devices: {}",
                    one_line(&a.host_devices.join(", "))
                )?;
            }
            if a.vendor.is_some() {
                writeln!(
                    out,
                    "  guest ids:    {}:{}",
                    hex16(a.vendor),
                    hex16(a.device)
                )?;
            }
        }
    }
    writeln!(out, "GUEST PCI ({} functions)", v.guest.pci.len())?;
    writeln!(
        out,
        "  {:<14} {:<11} {:<11} {:<8} DRIVER",
        "ADDRESS", "VENDOR:DEV", "SUBSYSTEM", "CLASS"
    )?;
    for f in &v.guest.pci {
        writeln!(
            out,
            "  {:<14} {:<11} {:<11} {:<8} {}",
            one_line(&f.address),
            format!("{:04x}:{:04x}", f.vendor, f.device),
            format!(
                "{}:{}",
                hex16(f.subsystem_vendor),
                hex16(f.subsystem_device)
            ),
            format!("{:06x}", f.class),
            f.driver.as_deref().map_or("-".into(), one_line)
        )?;
    }
    if v.guest.pci_unreadable > 0 {
        writeln!(out, "  ({} entries unreadable)", v.guest.pci_unreadable)?;
    }
    match &v.guest.nvidia_smi {
        NvidiaSmi::Absent { .. } => writeln!(out, "GUEST NVIDIA-SMI: not in the image")?,
        NvidiaSmi::Failed {
            path,
            exit_code,
            message,
        } => writeln!(
            out,
            "GUEST NVIDIA-SMI: {} failed (exit {}): {}",
            one_line(path),
            exit_code.map_or("none".into(), |c| c.to_string()),
            one_line(message)
        )?,
        NvidiaSmi::TimedOut { path, after_ms } => writeln!(
            out,
            "GUEST NVIDIA-SMI: {} killed after {after_ms} ms",
            one_line(path)
        )?,
        NvidiaSmi::Ran {
            path,
            gpus,
            unparsed_lines,
            truncated,
        } => {
            writeln!(
                out,
                "GUEST NVIDIA-SMI ({}, {} GPUs)",
                one_line(path),
                gpus.len()
            )?;
            writeln!(
                out,
                "  {:<5} {:<36} {:<12} {:<12} {:<9} UUID",
                "INDEX", "NAME", "MEM TOTAL", "MEM USED", "MIG"
            )?;
            for g in gpus {
                writeln!(
                    out,
                    "  {:<5} {:<36} {:<12} {:<12} {:<9} {}",
                    g.index,
                    one_line(&g.name),
                    mib(g.memory_total_mib),
                    mib(g.memory_used_mib),
                    g.mig_mode.as_deref().map_or("-".into(), one_line),
                    one_line(&g.uuid)
                )?;
            }
            if *unparsed_lines > 0 || *truncated {
                writeln!(
                    out,
                    "  ({unparsed_lines} lines not understood{})",
                    if *truncated { ", output cut" } else { "" }
                )?;
            }
        }
    }
    writeln!(
        out,
        "FINDINGS (memory tolerance {MEMORY_TOLERANCE_PERCENT} %)"
    )?;
    if v.findings.is_empty() {
        writeln!(out, "  OK        the guest sees what it was given")?;
    }
    for f in &v.findings {
        let level = match f.level {
            FindingLevel::Mismatch => "MISMATCH",
            FindingLevel::Note => "NOTE",
        };
        writeln!(out, "  {level:<9} {}", one_line(&f.message))?;
    }
    Ok(())
}

/// Runs `tenantvm gpu-info`.
pub(super) async fn run(
    client: &Client,
    a: GpuInfoArgs,
    out: &mut dyn Write,
) -> Result<(), CliFailure> {
    let view: GpuInfoView = client.gpu_info(&a.name).await?;
    if a.json {
        output::print_json(out, &view)?;
    } else {
        print_view(out, &view)?;
    }
    if view.matches {
        Ok(())
    } else {
        Err(fail(
            exit::GPU_MISMATCH,
            format!(
                "the guest's view of its GPU does not match what tenant {} was given (see above)",
                one_line(&view.tenant)
            ),
        ))
    }
}
