//! Raw mode for the host terminal while it is the guest's serial console, so that keys
//! (Ctrl-C included) reach the guest one by one instead of being line-edited or turned
//! into signals by the host's tty driver.

use std::os::fd::RawFd;

/// Restores the terminal's previous settings when dropped.
pub struct RawTerminal {
    fd: RawFd,
    saved: libc::termios,
}

impl RawTerminal {
    /// Puts `fd` in raw mode if it is a terminal; returns `None` (and changes nothing)
    /// when it is not, or when its settings cannot be read or changed.
    pub fn enable(fd: RawFd) -> Option<Self> {
        // SAFETY: isatty only inspects the descriptor number.
        if unsafe { libc::isatty(fd) } != 1 {
            return None;
        }
        // SAFETY: termios is plain data; all-zero is a valid value to be overwritten.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` is a valid termios for tcgetattr to fill.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        // SAFETY: cfmakeraw only edits the struct it is given.
        unsafe { libc::cfmakeraw(&mut raw) };
        // Keep output post-processing so that the guest's "\n" still starts a new line.
        raw.c_oflag = saved.c_oflag;
        // SAFETY: `raw` is a valid termios derived from the terminal's own settings.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            return None;
        }
        Some(Self { fd, saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        // SAFETY: restores the settings read from this same descriptor in `enable`.
        unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn non_terminals_are_left_alone() {
        let file = tempfile::tempfile().unwrap();
        assert!(RawTerminal::enable(file.as_raw_fd()).is_none());
    }
}
