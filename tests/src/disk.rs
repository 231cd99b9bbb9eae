//! A small disk of a test's own (a `tmpfs` of a given size, mounted in the test's folder) that
//! the test fills and frees: the full-disk seam, for real, without touching the machine's disks.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct SmallDisk {
    pub path: PathBuf,
}

impl SmallDisk {
    /// Mounts a `bytes`-sized tmpfs at `path` (created). Needs root, as CI and the test command
    /// run; panics with the reason otherwise.
    pub fn mount(path: &Path, bytes: u64) -> SmallDisk {
        SmallDisk::mount_with(path, &format!("size={bytes},mode=0700"))
    }

    /// A disk nothing can be written to, not even by root (the unwritable-folder seam, which
    /// file modes cannot give a test run as root).
    pub fn mount_read_only(path: &Path) -> SmallDisk {
        SmallDisk::mount_with(path, "size=65536,mode=0755,ro")
    }

    fn mount_with(path: &Path, options: &str) -> SmallDisk {
        std::fs::create_dir_all(path).expect("the mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(path)
            .output()
            .expect("mount runs");
        assert!(
            out.status.success(),
            "mounting a small tmpfs (the full-disk test needs root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk {
            path: path.to_owned(),
        }
    }

    fn filler(&self) -> PathBuf {
        self.path.join("filler")
    }

    /// Fills the disk until a write fails for want of space.
    pub fn fill(&self) {
        let mut f = std::fs::File::create(self.filler()).expect("the filler file");
        let chunk = vec![0u8; 4096];
        loop {
            match f.write_all(&chunk).and_then(|()| f.flush()) {
                Ok(()) => continue,
                Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
                Err(e) => panic!("filling the disk: {e}"),
            }
        }
    }

    /// Frees what [`SmallDisk::fill`] took.
    pub fn free(&self) {
        std::fs::remove_file(self.filler()).expect("the filler file goes");
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let unmounted = Command::new("umount")
            .arg("--lazy")
            .arg(&self.path)
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            eprintln!("could not unmount the test disk at {}", self.path.display());
        }
    }
}
