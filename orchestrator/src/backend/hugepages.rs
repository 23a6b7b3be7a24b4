//! Which huge pages back a VM's RAM, decided at each launch from the tenant's spec and the
//! host's reserved pools (`/sys/kernel/mm/hugepages/hugepages-<kB>kB/free_hugepages`).
//!
//! A GPU tenant's RAM is pinned for the device's DMA anyway: on huge pages it is pinned and
//! mapped in large pieces, never split, and the host's ordinary memory is not fragmented by
//! it. So a GPU tenant whose spec says nothing gets them where the host has enough free
//! (1 GiB pages first, then 2 MiB), and ordinary pages otherwise; other tenants get
//! ordinary pages unless their spec asks. A size the spec names must be there: a host with
//! too few free pages fails the launch with what to do, before the VMM starts.

use std::path::{Path, PathBuf};

use tenantvm_vmm_api::HugePages;

use crate::domain::spec::HugePagesSetting;

/// Where the host's huge page pools are described.
pub const POOLS_DIR: &str = "sys/kernel/mm/hugepages";

/// The host cannot give the huge pages a spec names.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the tenant asks for {needed} free {pages} huge pages for its {memory_mib} MiB of RAM, and the host has {free}; reserve more (echo N > {pool}/nr_hugepages, or hugepagesz=1G hugepages=N on the kernel command line for 1G pages), or set `hugepages = \"off\"`")]
pub struct NotEnoughHugePages {
    /// The page size.
    pub pages: HugePages,
    /// Pages the RAM needs.
    pub needed: u64,
    /// Pages the host has free.
    pub free: u64,
    /// The guest's RAM.
    pub memory_mib: u32,
    /// The pool's directory.
    pub pool: PathBuf,
}

/// The free pages of the host's pools under `root` (`/` on a real host).
pub struct HostPools {
    root: PathBuf,
}

impl HostPools {
    /// The pools under `root`.
    pub fn new(root: impl Into<PathBuf>) -> HostPools {
        HostPools { root: root.into() }
    }

    fn pool(&self, pages: HugePages) -> PathBuf {
        self.root.join(POOLS_DIR).join(pages.sysfs_dir())
    }

    /// Free pages of `pages`' pool (0 when the pool does not exist).
    pub fn free(&self, pages: HugePages) -> u64 {
        std::fs::read_to_string(self.pool(pages).join("free_hugepages"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// The huge pages for a VM of `memory_mib` whose spec says `setting`, a GPU tenant or not,
/// on a host with `pools`.
pub fn choose(
    setting: Option<HugePagesSetting>,
    gpu_tenant: bool,
    memory_mib: u32,
    pools: &HostPools,
) -> Result<Option<HugePages>, NotEnoughHugePages> {
    let fits = |pages: HugePages| {
        let needed = pages.pages_for(memory_mib.into())?;
        Some((needed, pools.free(pages)))
    };
    match setting {
        Some(HugePagesSetting::Off) => Ok(None),
        Some(HugePagesSetting::Pages(pages)) => {
            // The spec's validation made the memory a whole number of pages.
            let (needed, free) = fits(pages).unwrap_or((u64::MAX, 0));
            if free < needed {
                return Err(NotEnoughHugePages {
                    pages,
                    needed,
                    free,
                    memory_mib,
                    pool: Path::new("/").join(POOLS_DIR).join(pages.sysfs_dir()),
                });
            }
            Ok(Some(pages))
        }
        None if gpu_tenant => Ok([HugePages::Size1G, HugePages::Size2M]
            .into_iter()
            .find(|p| fits(*p).is_some_and(|(needed, free)| free >= needed))),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FAKE host with `free_2m` and `free_1g` free pages.
    fn pools(free_2m: u64, free_1g: u64) -> (tempfile::TempDir, HostPools) {
        let dir = tempfile::tempdir().unwrap();
        for (pages, free) in [(HugePages::Size2M, free_2m), (HugePages::Size1G, free_1g)] {
            let pool = dir.path().join(POOLS_DIR).join(pages.sysfs_dir());
            std::fs::create_dir_all(&pool).unwrap();
            std::fs::write(pool.join("free_hugepages"), format!("{free}\n")).unwrap();
        }
        let pools = HostPools::new(dir.path());
        (dir, pools)
    }

    const TWO_M: Option<HugePagesSetting> = Some(HugePagesSetting::Pages(HugePages::Size2M));

    #[test]
    fn a_gpu_tenant_gets_the_largest_pages_the_host_has_free() {
        let (_d, both) = pools(8192, 8);
        assert_eq!(choose(None, true, 8192, &both), Ok(Some(HugePages::Size1G)));
        // Not a whole number of 1G pages, or too few of them: 2M.
        assert_eq!(choose(None, true, 1536, &both), Ok(Some(HugePages::Size2M)));
        assert_eq!(
            choose(None, true, 16384, &both),
            Ok(Some(HugePages::Size2M))
        );
        // None reserved: ordinary pages, no error (the default is a preference).
        let (_d, none) = pools(0, 0);
        assert_eq!(choose(None, true, 8192, &none), Ok(None));
        // The control: a tenant without a GPU gets ordinary pages on the same host.
        assert_eq!(choose(None, false, 8192, &both), Ok(None));
    }

    #[test]
    fn a_size_the_spec_names_must_be_free_and_off_is_off() {
        let (_d, few) = pools(100, 0);
        assert_eq!(choose(TWO_M, false, 128, &few), Ok(Some(HugePages::Size2M)));
        let err = choose(TWO_M, false, 256, &few).unwrap_err();
        assert_eq!((err.needed, err.free), (128, 100));
        assert!(
            err.to_string().contains("hugepages-2048kB/nr_hugepages"),
            "{err}"
        );
        let (_d, many) = pools(4096, 8);
        assert_eq!(
            choose(Some(HugePagesSetting::Off), true, 8192, &many),
            Ok(None)
        );
    }
}
