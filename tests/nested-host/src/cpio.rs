//! A minimal writer of `newc` cpio archives (the initramfs format), for the small
//! initramfs images the scenario programs build for inner guests.

/// An archive being built in memory.
#[derive(Default)]
pub struct Cpio {
    out: Vec<u8>,
    ino: u32,
}

impl Cpio {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            if mode & 0o170000 == 0o040000 { 2 } else { 1 },
            0, // mtime
            data.len() as u32,
            0,
            0,
            0,
            0,
            name.len() as u32 + 1,
            0, // check
        ];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while self.out.len() % 4 != 0 {
            self.out.push(0);
        }
    }

    /// A directory (parents first).
    pub fn dir(&mut self, name: &str) -> &mut Self {
        self.entry(name, 0o040755, &[]);
        self
    }

    /// A regular file; `exec` makes it 0755, else 0644.
    pub fn file(&mut self, name: &str, data: &[u8], exec: bool) -> &mut Self {
        self.entry(name, if exec { 0o100755 } else { 0o100644 }, data);
        self
    }

    /// A symbolic link to `target`.
    pub fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.entry(name, 0o120777, target.as_bytes());
        self
    }

    /// The archive with its trailer.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_archive_is_newc_that_cpio_lists() {
        let mut c = Cpio::new();
        c.dir("bin")
            .file("bin/x", b"hello", true)
            .symlink("bin/y", "x");
        let bytes = c.finish();
        assert!(bytes.starts_with(b"070701"));
        assert_eq!(bytes.len() % 4, 0);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.cpio");
        std::fs::write(&path, &bytes).unwrap();
        let Ok(out) = std::process::Command::new("cpio")
            .args(["-it", "--quiet", "-F"])
            .arg(&path)
            .output()
        else {
            tenantvm_skip::skip!("cpio is not installed (run scripts/setup.sh)");
        };
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "bin\nbin/x\nbin/y\n");
    }
}
