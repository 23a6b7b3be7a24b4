//! The raw image file behind a virtio-blk device: positional vectored I/O straight
//! between the file and guest memory, fdatasync, and fallocate for discard and
//! write-zeroes.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use vm_memory::guest_memory::GuestMemorySliceIterator;
use vm_memory::{GuestMemory, Permissions};

use super::request::Descriptor;
use super::{ID_BYTES, SECTOR_SHIFT, SECTOR_SIZE};

/// Why an image could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The file could not be opened.
    #[error("Cannot open disk image {path}: {source}; check the path and its permissions")]
    Open {
        /// Image path.
        path: String,
        /// Cause.
        source: io::Error,
    },
    /// The file is smaller than one sector.
    #[error("Disk image {0} is smaller than one 512-byte sector")]
    TooSmall(String),
    /// The file is not a regular file or block device.
    #[error("Disk image {0} is not a regular file or block device")]
    NotAFile(String),
}

/// An open image.
#[derive(Debug)]
pub struct DiskFile {
    file: File,
    sectors: u64,
    read_only: bool,
    regular: bool,
    id: [u8; ID_BYTES],
}

impl DiskFile {
    /// Opens `path` (read-only when asked). The size is rounded down to whole sectors.
    /// `id` is the serial the guest reads (GET_ID); by default one derived from the
    /// file's device and inode numbers.
    pub fn open(path: &Path, read_only: bool, id: Option<&str>) -> Result<Self, DiskError> {
        let display = path.display().to_string();
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|source| DiskError::Open {
                path: display.clone(),
                source,
            })?;
        let meta = file.metadata().map_err(|source| DiskError::Open {
            path: display.clone(),
            source,
        })?;
        let regular = meta.file_type().is_file();
        let size = if regular {
            meta.len()
        } else if meta.file_type().is_block_device() {
            // SAFETY: lseek on a valid fd owned by `file`; no memory is involved.
            let end = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_END) };
            u64::try_from(end).map_err(|_| DiskError::NotAFile(display.clone()))?
        } else {
            return Err(DiskError::NotAFile(display));
        };
        let sectors = size >> SECTOR_SHIFT;
        if sectors == 0 {
            return Err(DiskError::TooSmall(display));
        }
        let mut serial = [0u8; ID_BYTES];
        let text = match id {
            Some(id) => id.to_string(),
            None => format!("tvm-{:x}-{:x}", meta.dev(), meta.ino()),
        };
        let n = text.len().min(ID_BYTES);
        serial[..n].copy_from_slice(&text.as_bytes()[..n]);
        Ok(Self {
            file,
            sectors,
            read_only,
            regular,
            id: serial,
        })
    }

    /// Size in sectors.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    /// Whether the image is read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Whether discard and write-zeroes can use fallocate (regular files).
    pub fn supports_fallocate(&self) -> bool {
        self.regular && !self.read_only
    }

    /// The GET_ID serial.
    pub fn id(&self) -> &[u8; ID_BYTES] {
        &self.id
    }

    /// Reads (`write == false`) or writes the file at `offset` from/into the guest
    /// buffers `data`, which the parser has checked lie in guest memory.
    pub fn transfer<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        data: &[Descriptor],
        offset: u64,
        write: bool,
    ) -> io::Result<u64> {
        let mut slices = Vec::new();
        for d in data {
            let access = if write {
                Permissions::Read
            } else {
                Permissions::Write
            };
            let iter = mem
                .get_slices(d.addr, d.len as usize, access)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
            for slice in iter
                .stop_on_error()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?
            {
                slices.push(slice);
            }
        }
        let mut iovecs: Vec<libc::iovec> = slices
            .iter()
            .map(|s| libc::iovec {
                iov_base: s.ptr_guard_mut().as_ptr().cast(),
                iov_len: s.len(),
            })
            .collect();
        let total: usize = iovecs.iter().map(|v| v.iov_len).sum();
        let mut done = 0usize;
        let mut first = 0usize;
        while done < total {
            let chunk = &iovecs[first..iovecs.len().min(first + 1024)];
            let pos = offset
                .checked_add(done as u64)
                .and_then(|p| i64::try_from(p).ok())
                .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
            // At most 1024 iovecs (IOV_MAX) per call.
            let count = i32::try_from(chunk.len())
                .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
            // SAFETY: every iovec points into a VolatileSlice of guest memory held alive
            // by `slices` for this whole function, with its exact length; the kernel
            // reads or writes at most that many bytes. The fd is owned by `self.file`.
            let n = unsafe {
                if write {
                    libc::pwritev(self.file.as_raw_fd(), chunk.as_ptr(), count, pos)
                } else {
                    libc::preadv(self.file.as_raw_fd(), chunk.as_ptr(), count, pos)
                }
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            let mut n = n as usize;
            done += n;
            // Skip the iovecs this call completed; shorten a partly done one.
            while n > 0 && first < iovecs.len() {
                let v = &mut iovecs[first];
                if n >= v.iov_len {
                    n -= v.iov_len;
                    first += 1;
                } else {
                    // SAFETY: advancing inside the same buffer by fewer bytes than its length.
                    v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                    v.iov_len -= n;
                    n = 0;
                }
            }
        }
        drop(slices);
        Ok(total as u64)
    }

    /// Makes written data durable (fdatasync).
    pub fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// Deallocates `count` sectors at `sector`. File systems without hole punching make
    /// this a no-op (discard is advisory).
    pub fn discard(&self, sector: u64, count: u32) -> io::Result<()> {
        match self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            sector,
            count,
        ) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            other => other,
        }
    }

    /// Zeroes `count` sectors at `sector`: hole punching when `unmap`, else
    /// FALLOC_FL_ZERO_RANGE, else plain writes of zeroes.
    pub fn write_zeroes(&self, sector: u64, count: u32, unmap: bool) -> io::Result<()> {
        let mode = if unmap {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        match self.fallocate(mode, sector, count) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                self.write_zero_bytes(sector, count)
            }
            other => other,
        }
    }

    fn write_zero_bytes(&self, sector: u64, count: u32) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let zeroes = vec![0u8; 64 << 10];
        let mut offset = sector << SECTOR_SHIFT;
        let mut left = u64::from(count) * SECTOR_SIZE;
        while left > 0 {
            let n = usize::try_from(left).map_or(zeroes.len(), |left| left.min(zeroes.len()));
            self.file.write_all_at(&zeroes[..n], offset)?;
            offset += n as u64;
            left -= n as u64;
        }
        Ok(())
    }

    fn fallocate(&self, mode: i32, sector: u64, count: u32) -> io::Result<()> {
        if !self.supports_fallocate() {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        let offset = i64::try_from(sector << SECTOR_SHIFT)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let len = i64::from(count) * SECTOR_SIZE as i64;
        // SAFETY: fallocate on a valid fd owned by `self.file`; no memory is involved.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, offset, len) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
}
